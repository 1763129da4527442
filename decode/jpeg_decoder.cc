#include "decode/jpeg_decoder.h"

#include <algorithm>
#include <csetjmp>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "decode/detail/libjpeg_glue.h"

#include <jerror.h>

namespace stoke::decode {
namespace detail {

[[noreturn]] void OnError(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  err->code = StatusCode::kCorrupt;
  std::longjmp(err->jump, 1);
}

// msg_level -1 is a warning: the data is damaged even though libjpeg could go on (it pads
// truncated images with gray, skips bad Huffman codes). Strict decoding treats it as an error;
// lenient decoding counts it and keeps the first message.
void OnMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  if (err->allow_extraneous > 0 && cinfo->err->msg_code == JWRN_EXTRANEOUS_DATA) {
    const int skipped = cinfo->err->msg_parm.i[0], marker = cinfo->err->msg_parm.i[1];
    const bool restart = marker >= 0xD0 && marker <= 0xD7;
    if ((restart && skipped == err->allow_extraneous) || (marker == 0xD9 && skipped <= err->allow_extraneous)) return;
  }
  if (!err->strict) {
    if (err->warnings++ == 0) (*cinfo->err->format_message)(cinfo, err->message);
    return;
  }
  char buffer[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, buffer);
  std::snprintf(err->message, sizeof err->message, "libjpeg warning: %s", buffer);
  err->code = StatusCode::kCorrupt;
  std::longjmp(err->jump, 1);
}

// A progressive stream may hold thousands of tiny scans that each cost a full pass over the
// coefficients; libjpeg-turbo 2.1 has no limit of its own, so count scans here.
void OnProgress(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  auto* progress = reinterpret_cast<ProgressManager*>(cinfo->progress);
  auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > progress->max_scans) {
    auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
    std::snprintf(err->message, sizeof err->message, "more than %d progressive scans",
                  progress->max_scans);
    err->code = StatusCode::kCorrupt;
    std::longjmp(err->jump, 1);
  }
}

}  // namespace detail

namespace {

using detail::ErrorManager;
using detail::ProgressManager;
using detail::OnError;
using detail::OnMessage;
using detail::OnProgress;
using detail::ReadHeaderInto;
using detail::PixelLimitError;

}  // namespace

namespace {

JpegColorSpace FromLibjpeg(J_COLOR_SPACE cs) {
  switch (cs) {
    case JCS_GRAYSCALE: return JpegColorSpace::kGray;
    case JCS_YCbCr: return JpegColorSpace::kYCbCr;
    case JCS_RGB: return JpegColorSpace::kRgb;
    case JCS_CMYK: return JpegColorSpace::kCmyk;
    case JCS_YCCK: return JpegColorSpace::kYcck;
    default: return JpegColorSpace::kUnknown;
  }
}

uint16_t Read16(const std::byte* p, bool little) {
  auto b0 = static_cast<uint16_t>(p[0]), b1 = static_cast<uint16_t>(p[1]);
  return little ? static_cast<uint16_t>(b0 | (b1 << 8)) : static_cast<uint16_t>((b0 << 8) | b1);
}
uint32_t Read32(const std::byte* p, bool little) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    uint32_t b = static_cast<uint8_t>(p[little ? 3 - i : i]);
    v = (v << 8) | b;
  }
  return v;
}

}  // namespace

std::string_view ColorSpaceName(JpegColorSpace cs) {
  switch (cs) {
    case JpegColorSpace::kGray: return "gray";
    case JpegColorSpace::kYCbCr: return "ycbcr";
    case JpegColorSpace::kRgb: return "rgb";
    case JpegColorSpace::kCmyk: return "cmyk";
    case JpegColorSpace::kYcck: return "ycck";
    case JpegColorSpace::kUnknown: break;
  }
  return "unknown";
}

std::string_view SubsamplingName(Subsampling s) {
  switch (s) {
    case Subsampling::k444: return "4:4:4";
    case Subsampling::k422: return "4:2:2";
    case Subsampling::k420: return "4:2:0";
    case Subsampling::k440: return "4:4:0";
    case Subsampling::k411: return "4:1:1";
    case Subsampling::k410: return "4:1:0";
    case Subsampling::kGray: return "gray";
    case Subsampling::kOther: break;
  }
  return "other";
}

bool LooksLikeJpeg(std::span<const std::byte> data) {
  return data.size() >= 3 && data[0] == std::byte{0xFF} && data[1] == std::byte{0xD8} &&
         data[2] == std::byte{0xFF};
}

int ParseExifOrientation(std::span<const std::byte> app1) {
  static constexpr char kExif[6] = {'E', 'x', 'i', 'f', 0, 0};
  if (app1.size() < 14 || std::memcmp(app1.data(), kExif, 6) != 0) return 1;
  std::span<const std::byte> tiff = app1.subspan(6);
  bool little;
  if (tiff[0] == std::byte{'I'} && tiff[1] == std::byte{'I'}) {
    little = true;
  } else if (tiff[0] == std::byte{'M'} && tiff[1] == std::byte{'M'}) {
    little = false;
  } else {
    return 1;
  }
  if (Read16(tiff.data() + 2, little) != 42) return 1;
  uint32_t ifd = Read32(tiff.data() + 4, little);
  if (ifd > tiff.size() - 2 || ifd < 8) return 1;
  uint16_t entries = Read16(tiff.data() + ifd, little);
  for (uint32_t i = 0; i < entries; ++i) {
    size_t at = ifd + 2 + size_t{i} * 12;
    if (at + 12 > tiff.size()) return 1;
    const std::byte* e = tiff.data() + at;
    if (Read16(e, little) != 0x0112) continue;
    // Type SHORT (3), count 1: the value sits in the first two bytes of the value field.
    if (Read16(e + 2, little) != 3 || Read32(e + 4, little) != 1) return 1;
    int v = Read16(e + 8, little);
    return (v >= 1 && v <= 8) ? v : 1;
  }
  return 1;
}

struct JpegDecoder::State {
  jpeg_decompress_struct cinfo;
  ErrorManager err;
  ProgressManager progress;
  std::vector<uint8_t> cmyk_row;
  Image validate_scratch;  // Validate() output, reused
  std::vector<std::byte> synthetic;  // DecodeRegion with an index: the assembled JPEG, reused
  std::vector<uint32_t> offsets;     // and the index's offsets, expanded
  bool broken = false;  // jpeg_create_decompress failed; every call reports it
};

namespace detail {

void ReadHeaderInto(jpeg_decompress_struct* cinfo, const std::byte* data, size_t size,
                    JpegInfo* info) {
  jpeg_mem_src(cinfo, reinterpret_cast<const unsigned char*>(data), static_cast<unsigned long>(size));
  jpeg_save_markers(cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(cinfo, TRUE);
  // A progressive file may leave coefficients out (no last refinement scan, chroma DC only); by
  // default libjpeg then smooths each block with its neighbours. That depends on which blocks are
  // decoded, so a crop differed from the same rows of a full decode, and neither matched the
  // record stoke packs (the coefficients, transcoded to sequential, which nothing smooths). stoke
  // decodes the coefficients as they are, whichever way it is asked to.
  cinfo->do_block_smoothing = FALSE;
  info->width = static_cast<int>(cinfo->image_width);
  info->height = static_cast<int>(cinfo->image_height);
  info->components = cinfo->num_components;
  info->color_space = FromLibjpeg(cinfo->jpeg_color_space);
  info->progressive = cinfo->progressive_mode != 0;
  info->integral_sampling = true;
  info->subsampling = Subsampling::kOther;
  if (cinfo->num_components == 1) {
    info->subsampling = Subsampling::kGray;
  } else if (cinfo->num_components >= 3) {
    // Luma (first component) against chroma, when every chroma component is 1x1.
    bool chroma_1x1 = true;
    for (int c = 1; c < cinfo->num_components && c < 3; ++c) {
      chroma_1x1 &= cinfo->comp_info[c].h_samp_factor == 1 && cinfo->comp_info[c].v_samp_factor == 1;
    }
    const int h = cinfo->comp_info[0].h_samp_factor, v = cinfo->comp_info[0].v_samp_factor;
    if (chroma_1x1) {
      if (h == 1 && v == 1) info->subsampling = Subsampling::k444;
      if (h == 2 && v == 1) info->subsampling = Subsampling::k422;
      if (h == 2 && v == 2) info->subsampling = Subsampling::k420;
      if (h == 1 && v == 2) info->subsampling = Subsampling::k440;
      if (h == 4 && v == 1) info->subsampling = Subsampling::k411;
      if (h == 4 && v == 2) info->subsampling = Subsampling::k410;
    }
  }
  for (int c = 0; c < cinfo->num_components; ++c) {
    const jpeg_component_info& comp = cinfo->comp_info[c];
    if (cinfo->max_h_samp_factor % comp.h_samp_factor != 0 ||
        cinfo->max_v_samp_factor % comp.v_samp_factor != 0) {
      info->integral_sampling = false;
    }
  }
  info->orientation = 1;
  for (jpeg_saved_marker_ptr m = cinfo->marker_list; m != nullptr; m = m->next) {
    if (m->marker != JPEG_APP0 + 1) continue;
    int o = ParseExifOrientation(
        std::span(reinterpret_cast<const std::byte*>(m->data), m->data_length));
    if (o != 1) {
      info->orientation = o;
      break;
    }
  }
}

Status PixelLimitError(const JpegInfo& info, int64_t max_pixels) {
  return ResourceExhaustedError(fmt::format("{}x{} image exceeds the {}-pixel limit", info.width,
                                            info.height, max_pixels));
}

}  // namespace detail

namespace {

// One row of decoded CMYK to RGB. Adobe writes CMYK inverted (0 = full ink); plain CMYK is not.
void CmykRowToRgb(const uint8_t* cmyk, int n, bool inverted, uint8_t* rgb) {
  for (int x = 0; x < n; ++x) {
    int c = cmyk[4 * x], m = cmyk[4 * x + 1], y = cmyk[4 * x + 2], k = cmyk[4 * x + 3];
    if (!inverted) c = 255 - c, m = 255 - m, y = 255 - y, k = 255 - k;
    rgb[3 * x] = static_cast<uint8_t>((c * k + 127) / 255);
    rgb[3 * x + 1] = static_cast<uint8_t>((m * k + 127) / 255);
    rgb[3 * x + 2] = static_cast<uint8_t>((y * k + 127) / 255);
  }
}

}  // namespace

JpegDecoder::JpegDecoder(DecoderOptions options)
    : options_(options), state_(std::make_unique<State>()) {
  State* s = state_.get();
  s->cinfo.err = jpeg_std_error(&s->err.pub);
  s->err.pub.error_exit = OnError;
  s->err.pub.emit_message = OnMessage;
  s->err.strict = options_.strict;
  s->err.warnings = 0;
  s->err.allow_extraneous = 0;
  // Creation can fail too (out of memory, library/header mismatch); it reports through OnError.
  if (setjmp(s->err.jump)) {
    s->broken = true;
    return;
  }
  jpeg_create_decompress(&s->cinfo);
  s->progress.pub.progress_monitor = OnProgress;
  s->progress.max_scans = options_.max_scans;
  s->cinfo.progress = &s->progress.pub;
}

JpegDecoder::~JpegDecoder() { jpeg_destroy_decompress(&state_->cinfo); }

int JpegDecoder::last_warnings() const { return state_->err.warnings; }

std::string_view JpegDecoder::last_warning() const {
  return state_->err.warnings > 0 ? std::string_view(state_->err.message) : std::string_view();
}

Result<JpegInfo> JpegDecoder::ReadHeader(std::span<const std::byte> jpeg) {
  State* s = state_.get();
  JpegInfo info;
  if (s->broken) return InternalError(std::string("libjpeg: ") + s->err.message);
  if (jpeg.empty()) return CorruptError("empty input");
  s->err.warnings = 0;
  if (setjmp(s->err.jump)) {
    jpeg_abort_decompress(&s->cinfo);
    return Status(s->err.code, s->err.message);
  }
  ReadHeaderInto(&s->cinfo, jpeg.data(), jpeg.size(), &info);
  jpeg_abort_decompress(&s->cinfo);
  if (static_cast<int64_t>(info.width) * info.height > options_.max_pixels) {
    return PixelLimitError(info, options_.max_pixels);
  }
  return info;
}

Status JpegDecoder::Decode(std::span<const std::byte> jpeg, Image* out, int scale_denom,
                           JpegInfo* info_out) {
  if (scale_denom != 1 && scale_denom != 2 && scale_denom != 4 && scale_denom != 8) {
    return InvalidArgumentError(fmt::format("scale 1/{} (expected 1/1, 1/2, 1/4 or 1/8)", scale_denom));
  }
  if (jpeg.empty()) return CorruptError("empty input");
  State* s = state_.get();
  if (s->broken) return InternalError(std::string("libjpeg: ") + s->err.message);
  JpegInfo info;
  jpeg_decompress_struct* cinfo = &s->cinfo;
  s->err.warnings = 0;
  if (setjmp(s->err.jump)) {
    jpeg_abort_decompress(cinfo);
    return Status(s->err.code, s->err.message);
  }
  ReadHeaderInto(cinfo, jpeg.data(), jpeg.size(), &info);
  if (static_cast<int64_t>(info.width) * info.height > options_.max_pixels) {
    jpeg_abort_decompress(cinfo);
    return PixelLimitError(info, options_.max_pixels);
  }
  const bool cmyk =
      info.color_space == JpegColorSpace::kCmyk || info.color_space == JpegColorSpace::kYcck;
  if (info.color_space == JpegColorSpace::kGray) {
    cinfo->out_color_space = JCS_GRAYSCALE;
  } else if (cmyk) {
    cinfo->out_color_space = JCS_CMYK;  // libjpeg-turbo 2.1 cannot convert CMYK to RGB itself
  } else {
    cinfo->out_color_space = JCS_RGB;
  }
  cinfo->scale_num = 1;
  cinfo->scale_denom = static_cast<unsigned>(scale_denom);
  jpeg_start_decompress(cinfo);
  const int w = static_cast<int>(cinfo->output_width);
  const int h = static_cast<int>(cinfo->output_height);
  out->Reshape(w, h, cmyk ? 3 : cinfo->output_components);
  if (cmyk) {
    s->cmyk_row.resize(static_cast<size_t>(w) * 4);
    const bool inverted = cinfo->saw_Adobe_marker != 0;
    while (cinfo->output_scanline < cinfo->output_height) {
      uint8_t* dst = out->row(static_cast<int>(cinfo->output_scanline));
      JSAMPROW row = s->cmyk_row.data();
      jpeg_read_scanlines(cinfo, &row, 1);
      CmykRowToRgb(s->cmyk_row.data(), w, inverted, dst);
    }
  } else {
    while (cinfo->output_scanline < cinfo->output_height) {
      JSAMPROW rows[4];
      int n = 0;
      for (; n < 4 && cinfo->output_scanline + n < cinfo->output_height; ++n) {
        rows[n] = out->row(static_cast<int>(cinfo->output_scanline) + n);
      }
      jpeg_read_scanlines(cinfo, rows, static_cast<JDIMENSION>(n));
    }
  }
  jpeg_finish_decompress(cinfo);
  if (info_out != nullptr) *info_out = info;
  return OkStatus();
}

Status JpegDecoder::Validate(std::span<const std::byte> jpeg, JpegInfo* info_out) {
  JpegInfo info;
  STOKE_RETURN_IF_ERROR(Decode(jpeg, &state_->validate_scratch, 8, &info));
  if (!info.integral_sampling) {
    return CorruptError(detail::kFractionalSampling);
  }
  if (info_out != nullptr) *info_out = info;
  return OkStatus();
}

namespace {

// Zero bytes put before each marker of an assembled stream (see DecodeRegion).
constexpr size_t kPadding = 8;

// Column cropping costs a little setup and only saves IDCT/upsampling/colour work on the columns
// left out: worth it below this share of the width.
constexpr double kCropColumnsBelow = 0.8;

}  // namespace

Status ExpandRestartOffsets(const RestartIndex& index, std::vector<uint32_t>* offsets) {
  const size_t n = index.intervals;
  const auto* p = reinterpret_cast<const uint8_t*>(index.entries.data());
  auto le32 = [](const uint8_t* q) {
    return uint32_t{q[0]} | uint32_t{q[1]} << 8 | uint32_t{q[2]} << 16 | uint32_t{q[3]} << 24;
  };
  offsets->resize(n);
  if (n == 0) return CorruptError("restart index: no intervals");
  if (index.entry_bytes == 4 && index.entries.size() == 4 * n) {
    for (size_t i = 0; i < n; ++i) (*offsets)[i] = le32(p + 4 * i);
    return OkStatus();
  }
  if (index.entry_bytes == 2 && index.entries.size() == 4 + 2 * (n - 1)) {
    uint64_t at = le32(p);
    (*offsets)[0] = static_cast<uint32_t>(at);
    for (size_t i = 1; i < n; ++i) {
      at += uint32_t{p[4 + 2 * (i - 1)]} | uint32_t{p[5 + 2 * (i - 1)]} << 8;
      if (at > UINT32_MAX) return CorruptError("restart index: offsets past 4 GB");
      (*offsets)[i] = static_cast<uint32_t>(at);
    }
    return OkStatus();
  }
  return CorruptError(fmt::format("restart index: {} bytes of {}-byte entries for {} intervals", index.entries.size(),
                                  index.entry_bytes, n));
}

int ChooseRegionScale(int region_width, int region_height, int min_width, int min_height) {
  for (int d : {8, 4, 2}) {
    if (region_width >= static_cast<int64_t>(min_width) * d &&
        region_height >= static_cast<int64_t>(min_height) * d) {
      return d;
    }
  }
  return 1;
}

Result<DecodedRegion> JpegDecoder::DecodeRegion(std::span<const std::byte> jpeg, Region region,
                                                int min_width, int min_height, Image* out,
                                                int scale_denom, const RestartIndex* index) {
  if (scale_denom != 0 && scale_denom != 1 && scale_denom != 2 && scale_denom != 4 &&
      scale_denom != 8) {
    return InvalidArgumentError(fmt::format("decode region: scale 1/{} (expected 0 to choose, or "
                                            "1, 2, 4, 8)", scale_denom));
  }
  if (jpeg.empty()) return CorruptError("empty input");
  if (min_width <= 0 || min_height <= 0) {
    return InvalidArgumentError(fmt::format("decode region: minimum size {}x{} must be positive",
                                            min_width, min_height));
  }
  State* s = state_.get();
  if (s->broken) return InternalError(std::string("libjpeg: ") + s->err.message);
  JpegInfo info;
  DecodedRegion result;
  jpeg_decompress_struct* cinfo = &s->cinfo;
  s->err.warnings = 0;
  s->err.allow_extraneous = 0;
  if (setjmp(s->err.jump)) {
    s->err.allow_extraneous = 0;
    jpeg_abort_decompress(cinfo);
    return Status(s->err.code, s->err.message);
  }
  ReadHeaderInto(cinfo, jpeg.data(), jpeg.size(), &info);
  if (static_cast<int64_t>(info.width) * info.height > options_.max_pixels) {
    jpeg_abort_decompress(cinfo);
    return PixelLimitError(info, options_.max_pixels);
  }
  // Clamp the region to the image; an empty result means the caller's plan is wrong.
  const int x0 = std::clamp(region.x, 0, info.width), y0 = std::clamp(region.y, 0, info.height);
  const int x1 = std::clamp(region.x + region.width, x0, info.width);
  const int y1 = std::clamp(region.y + region.height, y0, info.height);
  if (x1 <= x0 || y1 <= y0) {
    jpeg_abort_decompress(cinfo);
    return InvalidArgumentError(fmt::format("decode region: {}x{}+{}+{} is outside the {}x{} image",
                                            region.width, region.height, region.x, region.y,
                                            info.width, info.height));
  }
  const Region clamped{x0, y0, x1 - x0, y1 - y0};
  const int d = scale_denom != 0
                    ? scale_denom
                    : ChooseRegionScale(clamped.width, clamped.height, min_width, min_height);
  const bool cmyk =
      info.color_space == JpegColorSpace::kCmyk || info.color_space == JpegColorSpace::kYcck;
  if (index != nullptr && !cmyk) {
    // Assemble a JPEG of just the restart intervals the region needs, one MCU of context around
    // it, then decode that whole at scale d. Offsets are at MCU boundaries, multiples of 8, so
    // they stay whole pixels at every scale.
    const bool single = cinfo->num_components == 1;
    const int mcu_w = 8 * (single ? 1 : cinfo->max_h_samp_factor);
    const int mcu_h = 8 * (single ? 1 : cinfo->max_v_samp_factor);
    const int grid_w = (info.width + mcu_w - 1) / mcu_w, grid_h = (info.height + mcu_h - 1) / mcu_h;
    const int k = index->restart_mcus;
    const size_t n = index->intervals;
    if (k <= 0 || index->mcus_per_row != grid_w || index->mcu_rows != grid_h || grid_w % k != 0 ||
        n != static_cast<size_t>(grid_w / k) * static_cast<size_t>(grid_h) || n == 0 || cinfo->progressive_mode ||
        cinfo->restart_interval != static_cast<unsigned>(k)) {
      jpeg_abort_decompress(cinfo);
      return CorruptError(fmt::format("restart index ({} intervals of {} MCUs, {} x {}) does not match the {}x{} "
                                      "JPEG's MCU grid ({} x {}, restart interval {})",
                                      n, k, index->mcus_per_row, index->mcu_rows, info.width, info.height, grid_w,
                                      grid_h, cinfo->restart_interval));
    }
    const int per_row = grid_w / k;
    const int cx0 = std::max(0, x0 - mcu_w), cx1 = std::min(info.width, x1 + mcu_w);
    const int cy0 = std::max(0, y0 - mcu_h), cy1 = std::min(info.height, y1 + mcu_h);
    const int j0 = cx0 / mcu_w / k, j1 = ((cx1 + mcu_w - 1) / mcu_w + k - 1) / k;
    const int r0 = cy0 / mcu_h, r1 = (cy1 + mcu_h - 1) / mcu_h;
    const int sx = j0 * k * mcu_w, sy = r0 * mcu_h;
    const int sw = std::min(info.width, j1 * k * mcu_w) - sx, sh = std::min(info.height, r1 * mcu_h) - sy;
    jpeg_abort_decompress(cinfo);
    // Scoped: libjpeg may longjmp out of the calls below, which must not skip a live destructor.
    if (Status expanded = ExpandRestartOffsets(*index, &s->offsets); !expanded.ok()) return expanded;
    const std::vector<uint32_t>& offsets = s->offsets;
    const uint32_t scan = offsets[0];
    std::vector<std::byte>& b = s->synthetic;
    b.clear();
    if (scan < 4 || scan > jpeg.size()) return CorruptError("restart index: the scan starts outside the JPEG");
    b.insert(b.end(), jpeg.begin(), jpeg.begin() + scan);
    // The frame header gets the assembled image's size; the first interval must start where the
    // scan header ends.
    bool patched = false, scan_header_ends_there = false;
    for (size_t at = 2; at + 4 <= b.size() && b[at] == std::byte{0xFF};) {
      const auto marker = static_cast<uint8_t>(b[at + 1]);
      const size_t len = (static_cast<size_t>(b[at + 2]) << 8) | static_cast<size_t>(b[at + 3]);
      if ((marker == 0xC0 || marker == 0xC1) && at + 9 <= b.size()) {  // Huffman, sequential
        b[at + 5] = static_cast<std::byte>(sh >> 8);
        b[at + 6] = static_cast<std::byte>(sh & 0xFF);
        b[at + 7] = static_cast<std::byte>(sw >> 8);
        b[at + 8] = static_cast<std::byte>(sw & 0xFF);
        patched = true;
      }
      if (marker == 0xDA) {
        scan_header_ends_there = at + 2 + len == b.size();
        break;
      }
      at += 2 + len;
    }
    if (!patched) return CorruptError("restart index: no sequential frame header before the scan");
    if (!scan_header_ends_there) {
      return CorruptError(fmt::format("restart index: interval 0 is listed at {}, not where the scan header ends",
                                      scan));
    }
    int segment = 0;
    for (int r = r0; r < r1; ++r) {
      for (int j = j0; j < j1; ++j) {
        const size_t i = static_cast<size_t>(r) * static_cast<size_t>(per_row) + static_cast<size_t>(j);
        const uint32_t start = offsets[i];
        const bool last = i + 1 == n;
        const uint64_t next = last ? jpeg.size() : uint64_t{offsets[i + 1]};
        // Interval i > 0 begins right after RST((i - 1) mod 8) and every interval ends at the marker
        // that follows it: RST(i mod 8), or EOI after the last. Byte stuffing keeps these two bytes
        // out of entropy-coded data, so a listed offset that is off by any number of bytes fails.
        const auto is = [&](uint64_t at, unsigned marker) {
          return jpeg[at] == std::byte{0xFF} && static_cast<unsigned>(jpeg[at + 1]) == marker;
        };
        if (start < scan || next < uint64_t{start} + 2 || next > jpeg.size() ||
            !is(next - 2, last ? 0xD9u : 0xD0u + static_cast<unsigned>(i % 8)) ||
            (i > 0 && !is(start - 2, 0xD0u + static_cast<unsigned>((i - 1) % 8)))) {
          return CorruptError(fmt::format(
              "restart index: interval {} (bytes {}..{}) does not lie between the JPEG's restart markers", i, start,
              next));
        }
        const uint64_t end = next - 2;
        if (segment > 0) {
          b.insert(b.end(), kPadding, std::byte{0});
          b.push_back(std::byte{0xFF});
          b.push_back(static_cast<std::byte>(0xD0 + (segment - 1) % 8));
        }
        b.insert(b.end(), jpeg.begin() + start, jpeg.begin() + static_cast<ptrdiff_t>(end));
        ++segment;
      }
    }
    b.insert(b.end(), kPadding, std::byte{0});
    b.push_back(std::byte{0xFF});
    b.push_back(std::byte{0xD9});
    // The padding before each marker keeps libjpeg-turbo's fast Huffman path (which reads a few
    // bytes ahead, and falls back to the slow path for the rest of an interval when it meets a
    // marker) running to the end of every interval; libjpeg skips it as extraneous data.
    s->err.allow_extraneous = static_cast<int>(kPadding);
    jpeg_mem_src(cinfo, reinterpret_cast<const unsigned char*>(b.data()), static_cast<unsigned long>(b.size()));
    jpeg_read_header(cinfo, TRUE);
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = static_cast<unsigned>(d);
    jpeg_start_decompress(cinfo);
    out->Reshape(static_cast<int>(cinfo->output_width), static_cast<int>(cinfo->output_height), 3);
    while (cinfo->output_scanline < cinfo->output_height) {
      JSAMPROW rows[4];
      int m = 0;
      for (; m < 4 && cinfo->output_scanline + static_cast<JDIMENSION>(m) < cinfo->output_height; ++m) {
        rows[m] = out->row(static_cast<int>(cinfo->output_scanline) + m);
      }
      jpeg_read_scanlines(cinfo, rows, static_cast<JDIMENSION>(m));
    }
    jpeg_finish_decompress(cinfo);
    s->err.allow_extraneous = 0;
    result.scale_denom = d;
    result.x = static_cast<double>(x0 - sx) / d;
    result.y = static_cast<double>(y0 - sy) / d;
    result.width = static_cast<double>(x1 - x0) / d;
    result.height = static_cast<double>(y1 - y0) / d;
    return result;
  }
  cinfo->out_color_space = cmyk ? JCS_CMYK : JCS_RGB;  // gray -> RGB is a libjpeg conversion
  cinfo->scale_num = 1;
  cinfo->scale_denom = static_cast<unsigned>(d);
  jpeg_start_decompress(cinfo);
  const auto out_w_full = static_cast<int>(cinfo->output_width);
  const auto out_h_full = static_cast<int>(cinfo->output_height);
  // The region at this scale: whole output pixels that cover it.
  const int row0 = y0 / d;
  const int row1 = std::min(out_h_full, (y1 + d - 1) / d);
  // Columns are cropped with one iMCU of margin on each side: libjpeg-turbo upsamples chroma at a
  // crop's edges as if they were the image's, so the columns next to them differ from a full
  // decode. Never for sampling ratios other than 1 and 2, where its cropped output is wrong
  // (seen with 4:1:0 and 2x4 sampling at scaled decodes).
  bool croppable = true;
  for (int c = 0; c < cinfo->num_components; ++c) {
    const jpeg_component_info& comp = cinfo->comp_info[c];
    const int rh = cinfo->max_h_samp_factor / comp.h_samp_factor;
    const int rv = cinfo->max_v_samp_factor / comp.v_samp_factor;
    croppable = croppable && rh * comp.h_samp_factor == cinfo->max_h_samp_factor && rh <= 2 &&
                rv * comp.v_samp_factor == cinfo->max_v_samp_factor && rv <= 2;
  }
  const int margin = cinfo->min_DCT_scaled_size * cinfo->max_h_samp_factor;
  JDIMENSION col0 = static_cast<JDIMENSION>(std::max(0, x0 / d - margin));
  JDIMENSION cols = static_cast<JDIMENSION>(std::min(out_w_full, (x1 + d - 1) / d + margin)) - col0;
  if (croppable && cols < kCropColumnsBelow * out_w_full) {
    jpeg_crop_scanline(cinfo, &col0, &cols);  // widens to the iMCU grid; updates output_width
  } else {
    col0 = 0;
    cols = static_cast<JDIMENSION>(out_w_full);
  }
  out->Reshape(static_cast<int>(cols), row1 - row0, 3);
  if (row0 > 0) jpeg_skip_scanlines(cinfo, static_cast<JDIMENSION>(row0));
  if (cmyk) s->cmyk_row.resize(static_cast<size_t>(cols) * 4);
  const bool inverted = cinfo->saw_Adobe_marker != 0;
  while (static_cast<int>(cinfo->output_scanline) < row1) {
    const int y = static_cast<int>(cinfo->output_scanline) - row0;
    if (cmyk) {
      JSAMPROW row = s->cmyk_row.data();
      jpeg_read_scanlines(cinfo, &row, 1);
      CmykRowToRgb(s->cmyk_row.data(), static_cast<int>(cols), inverted, out->row(y));
    } else {
      JSAMPROW rows[4];
      int n = 0;
      for (; n < 4 && y + n < row1 - row0; ++n) rows[n] = out->row(y + n);
      jpeg_read_scanlines(cinfo, rows, static_cast<JDIMENSION>(n));
    }
  }
  if (row1 == out_h_full) {
    // The region reaches the last row: finish like a full decode, so damage that libjpeg only
    // reports at the end (extraneous bytes, a missing EOI) is caught here too.
    jpeg_finish_decompress(cinfo);
  } else {
    // Stop here: the rows below the region are never decoded.
    jpeg_abort_decompress(cinfo);
  }
  result.scale_denom = d;
  result.x = static_cast<double>(x0) / d - col0;
  result.y = static_cast<double>(y0) / d - row0;
  result.width = static_cast<double>(x1 - x0) / d;
  result.height = static_cast<double>(y1 - y0) / d;
  return result;
}

}  // namespace stoke::decode
