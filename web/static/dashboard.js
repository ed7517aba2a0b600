// The parkq dashboard: polls /dashboard/state, streams chat replies over SSE.
"use strict";
const HEADERS = { "X-Parkq-Dashboard": "1" };
const $ = (id) => document.getElementById(id);
const lastTokens = new Map();  // worker -> [job id, tokens, time]
const OTHERS = "another key's job";  // a job whose id this key may not see

function cell(text, cls) {
  const td = document.createElement("td");
  if (cls) { const s = document.createElement("span"); s.className = "pill " + cls; s.textContent = text; td.appendChild(s); }
  else td.textContent = text;
  return td;
}

function row(cells) { const tr = document.createElement("tr"); cells.forEach((c) => tr.appendChild(c)); return tr; }

function rate(worker, job, now) {
  const prev = lastTokens.get(worker);
  lastTokens.set(worker, [job.id, job.tokens, now]);
  if (!prev || prev[0] !== job.id || now <= prev[2] || job.tokens < prev[1]) return "";
  return ((job.tokens - prev[1]) / (now - prev[2])).toFixed(1);
}

function render(s) {
  $("model").textContent = "model " + s.model;
  $("status").textContent = s.workers.length + " worker(s), " + s.queue.length + " waiting";
  $("workers").replaceChildren(...s.workers.map((w) => row([
    cell(w.name),
    cell(w.job ? (w.job.id ?? OTHERS) : "idle", w.job ? "running" : ""),
    cell(w.job ? w.job.priority : "", w.job ? w.job.priority : ""),
    cell(w.job ? String(w.job.tokens) : ""),
    cell(w.job ? rate(w.name, w.job, s.now) : ""),
    cell((w.checkpoint_bytes / 1e6).toFixed(2) + " MB"),
  ])));
  $("queue").replaceChildren(...s.queue.map((j) => row([
    cell(j.id ?? OTHERS), cell(j.state, j.state), cell(j.priority, j.priority), cell(j.age.toFixed(1)), cell(String(j.tokens)),
  ])));
  $("preemptions").replaceChildren(...s.preemptions.slice(0, 12).map((p) => row([
    cell(new Date(p.at * 1000).toLocaleTimeString()), cell(p.job ?? OTHERS), cell(p.tokens), cell(p.park_ms), cell(p.worker),
  ])));
  $("tenants").replaceChildren(...(s.tenants || []).map((t) => {
    const bar = document.createElement("td");
    const fill = document.createElement("span");
    fill.className = "share"; fill.style.width = t.share + "%";
    bar.append(fill, " " + t.share.toFixed(1) + " %");
    return row([cell(t.name), cell(String(t.tokens_hour)), cell(String(t.tokens_day)), bar]);
  }));
  const marks = s.preemptions.filter((p) => s.now - p.at < 300).map((p) => {
    const span = document.createElement("span");
    span.style.left = (100 * (1 - (s.now - p.at) / 300)).toFixed(2) + "%";
    span.title = p.job ?? OTHERS;
    return span;
  });
  $("timeline").replaceChildren(...marks);
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/state", { headers: HEADERS, credentials: "same-origin" });
    if (resp.status === 401) { $("app").hidden = true; $("login").hidden = false; return; }
    $("login").hidden = true; $("app").hidden = false;
    render(await resp.json());
  } catch (e) { $("status").textContent = "reconnecting..."; }
  setTimeout(poll, 500);
}

async function send() {
  const body = {
    model: "parkq", stream: true, temperature: 0,
    max_tokens: Number($("max-tokens").value) || 48,
    priority: $("priority").value,
    messages: [{ role: "user", content: $("message").value }],
  };
  $("reply").textContent = ""; $("chat-status").textContent = "waiting...";
  const t0 = performance.now();
  const resp = await fetch("/v1/chat/completions", {
    method: "POST", credentials: "same-origin",
    headers: { ...HEADERS, "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!resp.ok) { $("chat-status").textContent = "error " + resp.status; return; }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", first = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) { $("chat-status").textContent = chunk.error.message; continue; }
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : "";
        if (delta) {
          if (first === null) { first = performance.now(); $("chat-status").textContent = "first token after " + Math.round(first - t0) + " ms"; }
          $("reply").textContent += delta;
        }
      }
    }
  }
  $("chat-status").textContent += " - done";
}

if (new URLSearchParams(location.search).get("login") === "failed") $("login-failed").hidden = false;
$("send").addEventListener("click", send);
poll();
