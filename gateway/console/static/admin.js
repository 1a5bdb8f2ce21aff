// Admin console charts: <canvas data-chart='{"labels", "requests", "billable", "revenue"}'> becomes requests
// per day (bars) with billable revenue in dollars (a line, right axis), drawn by Chart.js (chart.umd.js).
// A static file because the console's CSP allows no inline script.
(function () {
  "use strict";
  function css(name, fallback) {
    var value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return value || fallback;
  }
  function draw(canvas) {
    if (canvas.dataset.drawn || typeof window.Chart === "undefined") return;
    canvas.dataset.drawn = "1";
    var data = JSON.parse(canvas.getAttribute("data-chart"));
    var primary = css("--primary", "#4f46e5"), ok = css("--ok", "#047857"), muted = css("--muted", "#6b7280");
    var grid = css("--border", "#e3e6ef");
    var money = function (v) { return "$" + Number(v).toLocaleString(undefined, {maximumFractionDigits: 4}); };
    new window.Chart(canvas, {
      data: {
        labels: data.labels,
        datasets: [
          {type: "bar", label: "Requests", data: data.requests, backgroundColor: primary, borderRadius: 4,
           maxBarThickness: 28, yAxisID: "y", order: 2},
          {type: "line", label: "Billable revenue", data: data.revenue, borderColor: ok, backgroundColor: ok,
           pointRadius: 2, tension: 0, yAxisID: "revenue", order: 1}
        ]
      },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        interaction: {mode: "index", intersect: false},
        plugins: {
          legend: {position: "bottom", labels: {color: muted, boxWidth: 12}},
          tooltip: {callbacks: {label: function (c) {
            return c.dataset.yAxisID === "revenue" ? " Revenue: " + money(c.parsed.y) : " Requests: " + c.parsed.y.toLocaleString();
          }}}
        },
        scales: {
          x: {grid: {display: false}, ticks: {color: muted, maxRotation: 0, autoSkipPadding: 12}},
          y: {beginAtZero: true, grid: {color: grid}, ticks: {color: muted, precision: 0}},
          revenue: {beginAtZero: true, position: "right", grid: {display: false},
                    ticks: {color: muted, callback: function (v) { return money(v); }}}
        }
      }
    });
  }
  function drawAll(root) { (root || document).querySelectorAll("canvas[data-chart]").forEach(draw); }
  if (document.readyState !== "loading") drawAll(); else document.addEventListener("DOMContentLoaded", function () { drawAll(); });
  document.addEventListener("htmx:afterSettle", function (event) { drawAll(event.target); });
})();
