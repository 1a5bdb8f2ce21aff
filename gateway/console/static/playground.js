// The playground: posts the conversation to /console/playground/chat and renders the SSE stream.
(function () {
  "use strict";
  document.addEventListener("DOMContentLoaded", function () {
    var form = document.getElementById("pg-form");
    if (!form) return;
    var log = document.getElementById("pg-log"), input = document.getElementById("pg-input");
    var send = document.getElementById("pg-send"), status = document.getElementById("pg-status");
    var csrf = document.querySelector('meta[name="csrf-token"]').content;
    var history = [];

    function bubble(kind, text) {
      var empty = document.getElementById("pg-empty");
      if (empty) empty.remove();
      var el = document.createElement("div");
      el.className = "msg msg-" + kind;
      el.textContent = text;
      log.appendChild(el);
      log.scrollTop = log.scrollHeight;
      return el;
    }

    input.addEventListener("keydown", function (e) {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
    });
    document.getElementById("pg-clear").addEventListener("click", function () {
      history = []; log.innerHTML = ""; status.textContent = "";
    });

    form.addEventListener("submit", async function (e) {
      e.preventDefault();
      var text = input.value.trim();
      if (!text) return;
      input.value = "";
      history.push({ role: "user", content: text });
      bubble("user", text);
      var out = bubble("assistant", "");
      out.classList.add("streaming");
      send.disabled = true; status.textContent = "waiting for the model…";
      var answer = "";
      try {
        var response = await fetch("/console/playground/chat", {
          method: "POST", credentials: "same-origin",
          headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf },
          body: JSON.stringify({ model: document.getElementById("pg-model").value, messages: history,
                                 max_tokens: parseInt(document.getElementById("pg-max-tokens").value || "256", 10) })
        });
        if (!response.ok) {
          var err = await response.json().catch(function () { return {}; });
          throw new Error((err.error && err.error.message) || ("HTTP " + response.status));
        }
        var reader = response.body.getReader(), decoder = new TextDecoder(), buffer = "";
        status.textContent = "streaming…";
        while (true) {
          var part = await reader.read();
          if (part.done) break;
          buffer += decoder.decode(part.value, { stream: true });
          var events = buffer.split("\n\n");
          buffer = events.pop();
          events.forEach(function (event) {
            var line = event.trim();
            if (line.indexOf("data:") !== 0) return;
            var data = line.slice(5).trim();
            if (data === "[DONE]") return;
            var chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.choices && chunk.choices[0] && chunk.choices[0].delta && chunk.choices[0].delta.content) {
              answer += chunk.choices[0].delta.content;
              out.textContent = answer;
              log.scrollTop = log.scrollHeight;
            }
            if (chunk.usage) status.textContent = chunk.usage.prompt_tokens + " prompt + " + chunk.usage.completion_tokens + " completion tokens · 1 request";
          });
        }
        history.push({ role: "assistant", content: answer });
      } catch (error) {
        out.remove();
        history.pop();
        bubble("error", error.message);
        status.textContent = "";
      } finally {
        out.classList.remove("streaming");
        send.disabled = false;
        input.focus();
      }
    });
  });
})();
