// Flatfare console behaviour: copy buttons, tabs, confirmations. No inline scripts (the CSP forbids them).
(function () {
  "use strict";
  function onReady(fn) { if (document.readyState !== "loading") fn(); else document.addEventListener("DOMContentLoaded", fn); }

  // <button data-copy="#id"> copies the text of #id (or data-copy-text) to the clipboard.
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy], [data-copy-text]");
    if (!button) return;
    var text = button.getAttribute("data-copy-text");
    if (text === null) { var source = document.querySelector(button.getAttribute("data-copy")); text = source ? source.textContent : ""; }
    var done = function () { var label = button.textContent; button.textContent = "Copied"; setTimeout(function () { button.textContent = label; }, 1500); };
    if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text).then(done, function () {}); }
    else { var area = document.createElement("textarea"); area.value = text; document.body.appendChild(area); area.select();
      try { document.execCommand("copy"); done(); } catch (e) {} document.body.removeChild(area); }
  });

  // <form data-confirm="..."> asks before submitting.
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  }, true);

  // <form data-autosubmit> is sent when one of its selects changes (its button stays for no-script use).
  document.addEventListener("change", function (event) {
    var form = event.target.closest && event.target.closest("form[data-autosubmit]");
    if (form && event.target.tagName === "SELECT") form.submit();
  });

  // [data-tabs] holds .tab buttons (data-tab="name") and .tab-panel elements (data-panel="name").
  onReady(function () {
    document.querySelectorAll("[data-tabs]").forEach(function (group) {
      group.addEventListener("click", function (event) {
        var tab = event.target.closest("[data-tab]");
        if (!tab) return;
        var name = tab.getAttribute("data-tab");
        group.querySelectorAll("[data-tab]").forEach(function (t) { t.classList.toggle("active", t === tab); });
        group.querySelectorAll("[data-panel]").forEach(function (p) { p.hidden = p.getAttribute("data-panel") !== name; });
      });
    });
  });
})();
