// The usage page's charts: <canvas data-usage-chart="daily|models|keys" data-chart='{...}'> drawn by
// Chart.js (chart.umd.js, vendored). A static file because the console's CSP allows no inline script.
(function () {
  "use strict";
  function css(name, fallback) {
    var value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return value || fallback;
  }
  var PALETTE = ["#4f46e5", "#0ea5e9", "#10b981", "#f59e0b", "#ef4444", "#8b5cf6", "#14b8a6", "#f97316"];
  function draw(canvas) {
    if (canvas.dataset.drawn || typeof window.Chart === "undefined") return;
    canvas.dataset.drawn = "1";
    var data = JSON.parse(canvas.getAttribute("data-chart"));
    var primary = css("--primary", "#4f46e5"), muted = css("--muted", "#6b7280"), grid = css("--border", "#e3e6ef");
    var kind = canvas.getAttribute("data-usage-chart");
    var axes = {x: {grid: {display: false}, ticks: {color: muted}},
                y: {beginAtZero: true, grid: {color: grid}, ticks: {color: muted, precision: 0}}};
    var config;
    if (kind === "daily") {
      var failed = data.requests.map(function (total, i) { return total - data.billable[i]; });
      config = {type: "bar", data: {labels: data.labels, datasets: [
        {label: "Counted", data: data.billable, backgroundColor: primary, borderRadius: 4, maxBarThickness: 26, stack: "r"},
        {label: "Failed (free)", data: failed, backgroundColor: grid, borderRadius: 4, maxBarThickness: 26, stack: "r"}]},
        options: {scales: {x: Object.assign({stacked: true}, axes.x), y: Object.assign({stacked: true}, axes.y)}}};
    } else {
      var part = data[kind];
      config = {type: "bar", data: {labels: part.labels, datasets: [
        {label: "Requests", data: part.requests, borderRadius: 4, maxBarThickness: 22,
         backgroundColor: part.labels.map(function (_, i) { return PALETTE[i % PALETTE.length]; })}]},
        options: {indexAxis: "y", scales: {x: axes.y, y: axes.x}, plugins: {legend: {display: false}}}};
    }
    config.options = Object.assign({responsive: true, maintainAspectRatio: false, animation: false,
                                    interaction: {mode: "index", intersect: false}}, config.options);
    config.options.plugins = Object.assign({legend: {labels: {color: muted, boxWidth: 12}}}, config.options.plugins || {});
    canvas.chart = new window.Chart(canvas, config);
  }
  function drawAll() { document.querySelectorAll("canvas[data-usage-chart]").forEach(draw); }
  if (document.readyState !== "loading") drawAll(); else document.addEventListener("DOMContentLoaded", drawAll);
})();
