// The monitor page: asks the server for each run's metrics lines written since its last request,
// keeps them per run and redraws the charts. No reload is ever needed; a run whose metrics file
// is replaced (a resume rewrites it) is read again from the start.
'use strict';

const palette = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf', '#8c564b', '#e377c2'];
const runs = [];  // per run: info from /api/runs and the records read so far
let pollMs = 1000;
let infoAge = 0;
let renderedBad = '';

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v; else if (k === 'style') e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function duration(s) {
  if (!isFinite(s) || s < 0) return '?';
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return h > 0 ? `${h}h ${m}m` : m > 0 ? `${m}m ${r}s` : `${r}s`;
}

function fmt(v, digits) { return v === undefined || v === null || !isFinite(v) ? '–' : Number(v).toFixed(digits); }

// ---- charts
const charts = {};
function makeChart(id, yLabel, opts = {}) {
  const ctx = document.getElementById(id);
  charts[id] = new Chart(ctx, {
    type: 'line',
    data: { datasets: [] },
    options: {
      animation: false, parsing: false, normalized: true, spanGaps: true, maintainAspectRatio: false,
      interaction: { mode: 'nearest', intersect: false },
      plugins: { legend: { labels: { boxWidth: 14, font: { size: 11 } } },
                 decimation: { enabled: true, algorithm: 'lttb', samples: 800 } },
      scales: { x: { type: 'linear', title: { display: true, text: 'step' } },
                y: { type: opts.log ? 'logarithmic' : 'linear', title: { display: true, text: yLabel },
                     min: opts.min, max: opts.max } },
    },
  });
}

function xOf(run, r) {
  return document.getElementById('xaxis').value === 'time' ? (r.time - run.t0) / 60 : r.step;
}

function series(run, type, field, scale = 1) {
  const out = [];
  for (const r of run.records) {
    if (r.type !== type || typeof r[field] !== 'number') continue;
    if (document.getElementById('xaxis').value === 'time' && typeof r.time !== 'number') continue;
    out.push({ x: xOf(run, r), y: r[field] * scale });
  }
  return out;
}

function line(run, label, data, style) {
  return Object.assign({ label: `${run.info.name}: ${label}`, data, borderColor: run.color, backgroundColor: run.color,
                         borderWidth: 1.5, pointRadius: 0, tension: 0 }, style || {});
}

function redraw() {
  const xLabel = document.getElementById('xaxis').value === 'time' ? 'minutes since the run started' : 'step';
  const sets = { 'c-loss': [], 'c-acc': [], 'c-lr': [], 'c-ips': [], 'c-wait': [] };
  for (const run of runs) {
    sets['c-loss'].push(line(run, 'train loss', series(run, 'train', 'loss')));
    sets['c-loss'].push(line(run, 'val loss', series(run, 'val', 'loss'), { borderDash: [6, 4], pointRadius: 2 }));
    sets['c-acc'].push(line(run, 'train top-1 %', series(run, 'train', 'top1', 100)));
    sets['c-acc'].push(line(run, 'val top-1 %', series(run, 'val', 'top1', 100), { borderDash: [6, 4], pointRadius: 2 }));
    sets['c-acc'].push(line(run, 'val top-5 %', series(run, 'val', 'top5', 100), { borderDash: [2, 3], pointRadius: 2 }));
    sets['c-lr'].push(line(run, 'learning rate', series(run, 'train', 'lr')));
    sets['c-ips'].push(line(run, 'images/s', series(run, 'train', 'images_per_s')));
    sets['c-wait'].push(line(run, 'data-wait %', series(run, 'train', 'data_wait', 100)));
  }
  for (const [id, datasets] of Object.entries(sets)) {
    const c = charts[id];
    c.data.datasets = datasets;
    c.options.scales.x.title.text = xLabel;
    if (id === 'c-loss') c.options.scales.y.type = document.getElementById('logloss').checked ? 'logarithmic' : 'linear';
    c.update('none');
  }
}

// ---- per-run status: epoch, step, ETA, state
function status(run) {
  let start = null, last = null, end = null, lastTrain = [], malformed = run.malformed;
  for (const r of run.records) {
    if (typeof r.step === 'number') last = r;
    if (r.type === 'start') { start = r; end = null; lastTrain = []; }
    else if (r.type === 'end') end = r;
    else if (r.type === 'train') { lastTrain.push(r); if (lastTrain.length > 20) lastTrain.shift(); }
  }
  const s = { step: last ? last.step : 0, total: start ? start.total_steps : null, perEpoch: start ? start.steps_per_epoch : null,
              epochs: start ? start.epochs : null, malformed };
  const age = run.info.metrics_age_s;
  // Not updating: silent for three of its own logging intervals (and at least a minute).
  let interval = 0;
  if (lastTrain.length >= 2) {
    interval = (lastTrain[lastTrain.length - 1].time - lastTrain[0].time) / (lastTrain.length - 1);
  }
  if (!run.info.has_metrics) s.state = 'waiting';
  else if (end) s.state = end.stopped ? 'stopped' : 'finished';
  else if (age !== undefined && age > Math.max(60, 10 * pollMs / 1000, 3 * interval)) s.state = 'stale';
  else s.state = 'training';
  if (lastTrain.length >= 2) {
    const a = lastTrain[0], b = lastTrain[lastTrain.length - 1];
    const rate = (b.step - a.step) / (b.time - a.time);
    s.stepsPerS = rate;
    if (s.total && rate > 0 && s.state === 'training') s.eta = (s.total - s.step) / rate;
    s.ips = b.images_per_s;
    s.wait = b.data_wait;
    s.loss = b.loss;
    s.lr = b.lr;
  }
  const vals = run.records.filter(r => r.type === 'val');
  if (vals.length) s.val = vals[vals.length - 1];
  return s;
}

function renderRuns() {
  const box = document.getElementById('runs');
  box.replaceChildren();
  for (const run of runs) {
    const s = status(run);
    const stateText = { training: 'training', finished: 'finished', stopped: 'stopped early', stale: 'not updating',
                        waiting: 'no metrics yet' }[s.state];
    const epoch = s.perEpoch ? Math.min(s.epochs, Math.floor(Math.max(0, s.step - 1) / s.perEpoch) + 1) : null;
    const card = el('div', { class: 'run', style: `--c: ${run.color}`, 'data-run': run.info.id, 'data-step': s.step,
                             'data-state': s.state },
      el('div', {}, el('span', { class: 'name' }, run.info.name), el('span', { class: `state ${s.state}` }, stateText)),
      el('div', { class: 'figures' },
        `step ${s.step}${s.total ? ' / ' + s.total : ''}` + (epoch ? ` · epoch ${epoch} / ${s.epochs}` : '') +
        (s.eta !== undefined ? ` · ETA ${duration(s.eta)}` : '')),
      el('div', { class: 'figures' },
        `loss ${fmt(s.loss, 4)} · lr ${s.lr !== undefined ? Number(s.lr).toPrecision(3) : '–'} · ${fmt(s.ips, 0)} img/s · ` +
        `data-wait ${s.wait !== undefined ? fmt(100 * s.wait, 1) + '%' : '–'}`),
      el('div', { class: 'figures' }, s.val ? `validation at step ${s.val.step}: top-1 ${fmt(100 * s.val.top1, 2)}%, ` +
        `top-5 ${fmt(100 * s.val.top5, 2)}%, loss ${fmt(s.val.loss, 4)}` : 'no validation yet'));
    if (s.malformed > 0) card.append(el('div', { class: 'warn' }, `${s.malformed} malformed metrics line(s) skipped`));
    box.append(card);
  }
}

function renderDetails() {
  const box = document.getElementById('details');
  const open = new Set([...box.querySelectorAll('details[open]')].map(d => d.dataset.key));
  box.replaceChildren();
  for (const run of runs) {
    const info = run.info;
    const section = (key, title, ...body) => {
      const d = el('details', { 'data-key': `${info.id}-${key}` }, el('summary', {}, `${info.name}: ${title}`), ...body);
      if (open.has(d.dataset.key)) d.open = true;
      box.append(d);
    };
    section('config', 'resolved config', el('div', {}, info.dir), el('pre', {}, info.config || 'no config.yaml yet'),
            info.config_error ? el('div', { class: 'error' }, info.config_error) : '');
    const ds = [];
    for (const [which, d] of Object.entries(info.datasets || {})) {
      if (d.error) { ds.push(el('p', { class: 'error' }, `${which}: ${d.error}`)); continue; }
      ds.push(el('p', {}, `${which}: ${d.path}: ${d.records} records in ${d.classes.length} classes, ` +
                          `${(d.payload_bytes / 1048576).toFixed(1)} MiB, format v${d.format_version}` +
                          (d.pack_skipped !== undefined ? `, skipped when packed: ${JSON.stringify(d.pack_skipped)}` : '')));
      const t = el('table', {}, el('tr', {}, el('th', {}, 'class'), el('th', {}, 'records')));
      d.classes.slice(0, 50).forEach(c => t.append(el('tr', {}, el('td', {}, c.name), el('td', { class: 'num' }, c.records))));
      if (d.classes.length > 50) t.append(el('tr', {}, el('td', {}, `… ${d.classes.length - 50} more`), el('td', {}, '')));
      ds.push(t);
    }
    section('dataset', 'dataset', ...(ds.length ? ds : [el('p', {}, 'no dataset named yet')]));
    const bad = run.records.filter(r => r.type === 'bad_record');
    const t = el('table', {}, el('tr', {}, el('th', {}, 'step'), el('th', {}, 'record'), el('th', {}, 'why')));
    bad.slice(-500).forEach(r => t.append(el('tr', {}, el('td', { class: 'num' }, r.step), el('td', { class: 'num' }, r.index),
                                             el('td', {}, r.reason))));
    section('skipped', `records skipped while training (${bad.length})`,
            bad.length ? t : el('p', {}, 'none'));
    const files = (info.files || []).map(f => el('a', { href: `/runs/${info.id}/${f}` }, f));
    section('files', 'files', el('p', {}, ...files.flatMap((a, i) => i ? [' · ', a] : [a])));
  }
}

// ---- polling
async function fetchJson(url) {
  const r = await fetch(url, { cache: 'no-store' });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

async function refreshInfo() {
  const j = await fetchJson('/api/runs');
  pollMs = j.poll_ms || pollMs;
  j.runs.forEach((info, i) => {
    if (!runs[i]) runs[i] = { info, color: palette[i % palette.length], records: [], offset: 0, fileId: '', malformed: 0, t0: 0 };
    runs[i].info = info;
  });
  renderDetails();
}

async function pollRun(run) {
  for (let rounds = 0; rounds < 64; ++rounds) {
    const j = await fetchJson(`/api/runs/${run.info.id}/metrics?from=${run.offset}`);
    if (!j.exists) return false;
    if (j.reset || (run.fileId && j.file_id !== run.fileId && run.offset > 0)) {
      // The file was rewritten (a resume trims it): read it again from the start.
      // Its time axis starts again too: a new run in the same folder starts at its own first line.
      if (!j.reset) { run.offset = 0; run.records = []; run.malformed = 0; run.t0 = 0; run.fileId = j.file_id; continue; }
      run.records = []; run.malformed = 0; run.t0 = 0;
    }
    run.fileId = j.file_id;
    for (const r of j.records) {
      if (!run.t0 && typeof r.time === 'number') run.t0 = r.time;
      run.records.push(r);
    }
    run.malformed += j.malformed;
    const more = j.offset < j.size - j.partial && j.offset > run.offset;
    const changed = j.records.length > 0 || j.reset;
    run.offset = j.offset;
    if (!more) return changed;
  }
  return true;
}

async function poll() {
  let changed = false;
  try {
    if (infoAge-- <= 0) { await refreshInfo(); infoAge = 5; changed = true; } else if (infoAge === 5) infoAge = 4;
    for (const run of runs) changed = (await pollRun(run)) || changed;
    if (changed) {
      redraw();
      const bad = runs.map(r => r.records.filter(x => x.type === 'bad_record').length).join();
      if (bad !== renderedBad || infoAge === 5) { renderDetails(); renderedBad = bad; }
    }
    renderRuns();
    document.getElementById('updated').textContent = `updated ${new Date().toLocaleTimeString()} · ` +
      `${runs.length} run(s) · polling every ${pollMs / 1000} s`;
  } catch (e) {
    document.getElementById('updated').textContent = `cannot reach the monitor (${e.message}); retrying`;
  }
  setTimeout(poll, pollMs);
}

makeChart('c-loss', 'loss');
makeChart('c-acc', '%', { min: 0, max: 100 });
makeChart('c-lr', 'learning rate');
makeChart('c-ips', 'images/s', { min: 0 });
makeChart('c-wait', '%', { min: 0 });
document.getElementById('xaxis').addEventListener('change', redraw);
document.getElementById('logloss').addEventListener('change', redraw);
poll();
