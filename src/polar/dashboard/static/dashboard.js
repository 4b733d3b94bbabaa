// The dashboard's own script: draws the charts the server describes in `data-chart` (uPlot) and shows
// whether the live stream is connected. Everything else is server-rendered HTML swapped in by htmx.
(function () {
  "use strict";
  const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

  // A value axis's tick label. uPlot's default rounds to 3 decimals, so a loss of 0.0004 read "0, 0, 0":
  // three significant digits instead, and exponents for the very small and very large.
  function tick(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a < 1e-3 || a >= 1e6) return v.toExponential(1);
    return String(Number(v.toPrecision(3)));
  }
  window.polarDashboard = {tick: tick};

  function drawChart(el) {
    if (el.dataset.drawn) return;
    el.dataset.drawn = "1";
    const spec = JSON.parse(el.dataset.chart);
    const names = Object.keys(spec.series);
    const points = Boolean(spec.points);
    const band = spec.band || [];  // two series names: the band between them is filled
    const opts = {
      title: spec.title,
      width: Math.max(320, el.clientWidth || 600),
      height: 220,
      scales: {x: {time: false}},
      // Sample indices and steps are whole numbers: no tick between them.
      axes: [
        {incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]},
        {size: 64, values: function (u, splits) { return splits.map(tick); }},
      ],
      series: [{label: spec.xlabel || (points ? "sample" : "step")}].concat(names.map(function (name, i) {
        if (band.indexOf(name) >= 0) {  // the edges of a band (mean ± std): thin, dashed, the mean's colour
          return {label: name, stroke: COLORS[0], width: 1, dash: [4, 4], points: {show: false}};
        }
        return {
          label: name,
          stroke: COLORS[i % COLORS.length],
          width: points ? 0 : 2,
          points: {show: points || spec.x.length < 40, size: points ? 8 : 5, fill: COLORS[i % COLORS.length]},
        };
      })),
    };
    if (band.length === 2) {
      opts.bands = [{series: [names.indexOf(band[0]) + 1, names.indexOf(band[1]) + 1], fill: "rgba(37, 99, 235, 0.12)"}];
    }
    const data = [spec.x].concat(names.map(function (n) { return spec.series[n]; }));
    new uPlot(opts, data, el);
  }

  document.addEventListener("htmx:load", function (evt) {
    evt.detail.elt.querySelectorAll("[data-chart]").forEach(drawChart);
    if (evt.detail.elt.matches && evt.detail.elt.matches("[data-chart]")) drawChart(evt.detail.elt);
  });
  document.addEventListener("htmx:sseOpen", function () {
    const live = document.getElementById("live");
    if (live) live.classList.add("on");
  });
  document.addEventListener("htmx:sseError", function () {
    const live = document.getElementById("live");
    if (live) live.classList.remove("on");
  });
})();
