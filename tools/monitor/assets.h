// The monitor page's files, compiled into the binary at build time (tools/monitor/embed.cmake):
// the page, its script, and Chart.js from Debian's libjs-chart.js. Valid for the program's life.
#pragma once

#include <string_view>

namespace stoke::monitor {

std::string_view PageHtml();  // tools/monitor/page.html
std::string_view AppJs();     // tools/monitor/app.js
std::string_view ChartJs();   // Chart.js (MIT licence), as Debian ships it

}  // namespace stoke::monitor
