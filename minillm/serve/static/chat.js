// The chat page's script (chat.html loads it; a file of its own for the page's CSP: no inline code).
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];          // the conversation so far: {role, content}
let model = null;            // the served model's name, from /v1/models
let controller = null;       // aborts the answer being streamed (the stop button)

function apiKey() { return $("api-key").value.trim(); }
function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";      // the server refuses other POST bodies
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

function bubble(kind, text) {
  const div = document.createElement("div");
  div.className = "msg " + kind;
  div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

// The server's error body is OpenAI's {"error": {"message": ...}}; say what to do about the common ones.
function showError(status, message) {
  const hints = {401: " Enter the server's API key under Settings.", 503: " The server is busy or stopping; try again."};
  const prefix = status ? `Error ${status}: ` : "Error: ";
  bubble("error", prefix + message + (hints[status] || ""));
  if (status === 401) { $("settings").open = true; $("api-key").focus(); }
}

async function errorMessage(response) {
  try { return (await response.json()).error.message; } catch (e) { return response.statusText; }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", {headers: headers(false)});
    if (!response.ok) { $("model").textContent = "model unknown"; showError(response.status, await errorMessage(response)); return; }
    model = (await response.json()).data[0].id;
    $("model").textContent = model;
    document.querySelectorAll(".error").forEach((e) => e.remove());   // e.g. the 401 before the key
  } catch (e) { $("model").textContent = "server unreachable"; }
}

// KV-cache usage and running requests, read from the Prometheus text the server exports.
async function pollMetrics() {
  try {
    const response = await fetch("/metrics", {headers: headers(false)});
    if (!response.ok) { $("server").textContent = "metrics unavailable"; return; }
    const text = await response.text();
    const value = (name) => {
      const m = text.match(new RegExp("^minillm:" + name + "\\{[^}]*\\} ([0-9.eE+-]+)$", "m"));
      return m ? Number(m[1]) : NaN;
    };
    const kv = value("kv_cache_usage_perc"), running = value("num_requests_running"), waiting = value("num_requests_waiting");
    $("server").textContent = `KV cache ${(100 * kv).toFixed(1)}% | running ${running} | waiting ${waiting}`;
    $("server").dataset.running = running;
  } catch (e) { $("server").textContent = "metrics unavailable"; }
}

// TTFT, TPOT and tokens/s from this stream's own timestamps: the request left at t0, the first
// text arrived at tFirst, the last at tLast; the usage chunk says how many tokens came.
function timings(t0, tFirst, tLast, tokens) {
  if (tFirst === null) return "no tokens";
  const parts = [`TTFT ${((tFirst - t0) / 1000).toFixed(2)} s`];
  if (tokens > 1) {
    const tpot = (tLast - tFirst) / (tokens - 1);
    parts.push(`TPOT ${tpot.toFixed(0)} ms`, `${(1000 / tpot).toFixed(1)} tok/s`);
  }
  parts.push(`${tokens} tokens`);
  return parts.join(" | ");
}

async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  const answer = bubble("assistant", "");
  const content = document.createElement("span");
  content.className = "content";
  const stats = document.createElement("span");
  stats.className = "stats";
  answer.append(content, stats);
  const body = {
    model, messages: history, stream: true, stream_options: {include_usage: true},
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  controller = new AbortController();
  setBusy(true);
  const metricsTimer = setInterval(pollMetrics, 1000);
  const t0 = performance.now();
  // tokens: the usage chunk's count; a stopped stream has none, so its text pieces are counted instead
  let tFirst = null, tLast = null, tokens = 0, pieces = 0, finish = null, failed = false;
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(true),
                                                          body: JSON.stringify(body), signal: controller.signal});
    if (!response.ok) { failed = true; showError(response.status, await errorMessage(response)); return; }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();                                   // an incomplete event waits for more bytes
      for (const event of events) {
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { failed = true; showError(500, chunk.error.message); continue; }
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices) {
          if (choice.delta.content) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            pieces += 1;
            content.textContent += choice.delta.content;
            answer.scrollIntoView({block: "end"});
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    if (finish === null && !failed) { failed = true; showError(0, "the connection closed before the answer finished"); }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { failed = true; showError(0, "the connection to the server dropped (" + e.message + ")"); }
  } finally {
    clearInterval(metricsTimer);
    controller = null;
    setBusy(false);
    if (content.textContent) history.push({role: "assistant", content: content.textContent});
    else history.pop();                                        // nothing came back: the turn is not kept
    stats.textContent = failed ? "" : timings(t0, tFirst, tLast, tokens || pieces) + (finish ? ` | ${finish}` : "");
    answer.dataset.done = finish || "error";
    setTimeout(pollMetrics, 300);                              // the server's state after the request left
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  if (model === null) { loadModel().then(() => model !== null && send(text)); return; }
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { history.length = 0; $("log").replaceChildren(); });
$("api-key").addEventListener("change", () => {
  localStorage.setItem("minillm-api-key", apiKey());
  if (model === null) loadModel();
});
$("api-key").value = localStorage.getItem("minillm-api-key") || "";
loadModel();
pollMetrics();
