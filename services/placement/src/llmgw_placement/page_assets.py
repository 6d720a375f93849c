"""The cluster page's static assets: the document around the view (its style and its script,
which follows `/page/stream` and applies each patch) and the chat box of an opened deployment.
"""

# The chat box: one chat completion sent by the browser itself to the gateway, with a key
# the user types and the browser keeps (sessionStorage, this tab only). Placement never sees
# the key or the answer: its page only reads (the read token in a cookie changes nothing),
# and the request is the one any client of the gateway makes, counted against that key.
CHAT = """<form id=chat data-keep data-gateway='{gateway}' data-model='{model}'>
<label>API key <input name=key type=password autocomplete=off
placeholder='sk-… (kept in this tab only)'></label>
<label class=ask>Message <textarea name=message rows=2 required>Say hello in five words.</textarea></label>
<button>send to {model}</button> <span id=chat-state></span>
<pre id=chat-answer></pre>
<noscript><p class=warn>The chat box needs JavaScript.</p></noscript>
</form>"""


PAGE = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width, initial-scale=1">
<title>llmgw cluster</title>
<noscript><meta http-equiv=refresh content="{reload}"></noscript>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.2em 0 .4em}h3{font-size:1em;margin:.8em 0 .3em}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.3em .5em;
text-align:left;vertical-align:top;overflow-wrap:break-word}th{background:#f4f4f4}
.wide{overflow-x:auto;max-width:100%}
.ok{color:#176117;font-weight:600}.bad{color:#a11;font-weight:600}.warn{color:#8a5a00}
.gpu{display:inline-block;min-width:4.5em;margin:1px;padding:1px 4px;border-radius:3px;font-size:12px}
.gpu small{display:block;font-size:10px}.gpu.free{background:#e8f3e8}.gpu.held{background:#dde6f7}
.gpu.unusable{background:#eee;color:#777}#summary{font-size:15px}#problems li{margin:.2em 0}
#problems{border-left:3px solid #a11;padding-left:.6em}#problems.none{border-left-color:#176117}
#problems code,code{overflow-wrap:anywhere;white-space:pre-wrap}
table.usage-by-key{margin-top:.8em}
.state.ready{color:#176117;font-weight:600}.state.failed,.state.degraded,.state.unknown{color:#a11}
pre{white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px;margin:.3em 0;background:#f8f8f8;padding:.3em}
.install{color:#555;font-style:italic}
.alert{background:#fbe9e9;color:#a11;font-weight:600;padding:.4em .6em;border-radius:3px}
#live{float:right;color:#777;font-size:13px;font-weight:normal}
ul.reasons{margin:.2em 0;padding-left:1.2em}time{color:#777}.nowrap{white-space:nowrap}
.grid{line-height:0;margin:.2em 0 .6em}
.c{display:inline-block;width:10px;height:10px;margin:1px;border-radius:2px;background:#bfe0bf}
.c.held{background:#6f93d8}.c.lost{background:#c33}.c.claimed{background:#c3c}.c.cordoned{background:#e0a020}
.c.dim{opacity:.15}#legend a{color:inherit;text-decoration:none;margin-right:.3em}
#legend i{vertical-align:middle}#find{margin:.5em 0}#find input{max-width:60vw}
.hint{background:#fff6dc;padding:.4em .6em;border-radius:3px}
#deployment{border:1px solid #ccd;padding:.2em .8em .6em;border-radius:4px}.close{float:right}
#dep-chart{margin:.4em 0}#dep-chart svg{max-width:100%;height:auto;background:#fafafa}
#dep-chart .axis{stroke:#ccc}#dep-chart polyline{stroke-width:1.5}
#dep-chart .demand{stroke:#36c;color:#36c}#dep-chart .replicas{stroke:#c60;color:#c60}
#dep-chart figcaption{font-size:12px;color:#555}
#chat label{display:block;margin:.3em 0}#chat textarea,#chat input{width:100%;box-sizing:border-box}
@media (max-width:600px){body{margin:.6em}td,th{padding:.2em .3em}#live{float:none;display:block}
.gpu{min-width:0;padding:0 3px}.gpu small{display:none}.sys{display:none}table.groups{font-size:12px}}
</style></head>
<body><h1>llmgw cluster <span id=live>as of {when}</span></h1>
<noscript><p class=hint id=nojs>This page is live only with JavaScript: without it, it reloads
itself every {reload} s (or reload it now for news).</p></noscript>
<main id=view>{view}</main>
<script>
const live = document.getElementById("live");
const view = document.getElementById("view");
live.textContent = "connecting…";
function make(html) {
  const t = document.createElement("template");
  t.innerHTML = html;
  return t.content.firstElementChild;
}
function dim() {
  const box = document.querySelector("#find input[name=node]");
  const want = box ? box.value.trim().toLowerCase() : "";
  for (const c of document.querySelectorAll(".grid .c")) {
    c.classList.toggle("dim", want !== "" && !c.id.slice(2).toLowerCase().includes(want));
  }
}
function whole(html) {
  // What the user is typing into (the filter, the chat box) stays as it is.
  const kept = [...view.querySelectorAll("[data-keep]")];
  view.innerHTML = html;
  for (const k of kept) {
    const fresh = document.getElementById(k.id);
    if (fresh) fresh.replaceWith(k);
  }
}
function patch(p) {
  const set = p.set || {};
  for (const [box, order] of Object.entries(p.order || {})) {
    const parent = document.getElementById(box);
    if (!parent) continue;
    const kids = order.map((id) => {
      if (id in set) { const el = make(set[id]); delete set[id]; return el; }
      return document.getElementById(id);
    }).filter(Boolean);
    parent.replaceChildren(...kids);
  }
  for (const [id, html] of Object.entries(set)) {
    const el = document.getElementById(id);
    if (el) el.replaceWith(make(html));
  }
}
function ago() {
  const now = Date.now() / 1000;
  for (const t of document.querySelectorAll("time[data-at]")) {
    const s = Math.max(0, Math.floor(now - Number(t.dataset.at)));
    t.textContent = s < 120 ? s + " s ago" : s < 7200 ? Math.floor(s / 60) + " min ago"
      : Math.floor(s / 3600) + " h ago";
  }
}
setInterval(ago, 1000);
function seen() { live.textContent = "live " + new Date().toLocaleTimeString(); dim(); ago(); }
const source = new EventSource("page/stream" + location.search);
source.addEventListener("view", (e) => { whole(e.data); seen(); });
source.addEventListener("patch", (e) => { patch(JSON.parse(e.data)); seen(); });
source.onerror = () => { live.textContent = "reconnecting…"; };
document.addEventListener("input", (e) => { if (e.target.closest("#find")) dim(); });
document.addEventListener("submit", async (e) => {
  const form = e.target;
  if (form.id !== "chat") return;
  e.preventDefault();
  const state = document.getElementById("chat-state");
  const answer = document.getElementById("chat-answer");
  const key = form.elements.key.value.trim();
  if (key) sessionStorage.setItem("llmgw-key", key);
  if (!form.dataset.gateway) { state.textContent = "no gateway_url in placement's config"; return; }
  state.textContent = "asking…";
  answer.textContent = "";
  const headers = {"Content-Type": "application/json"};
  if (key) headers.Authorization = "Bearer " + key;
  try {
    const r = await fetch(form.dataset.gateway + "/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify({
        model: form.dataset.model, max_tokens: 64,
        messages: [{role: "user", content: form.elements.message.value}]})});
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      state.textContent = "gateway answered " + r.status;
      answer.textContent = (body.error && body.error.message) || JSON.stringify(body);
      return;
    }
    state.textContent = "answered" + (body.usage ? ` (${body.usage.completion_tokens} tokens)` : "");
    answer.textContent = body.choices[0].message.content;
  } catch (err) {
    state.textContent = "cannot reach the gateway at " + form.dataset.gateway + ": " + err;
  }
});
const chatKey = document.querySelector("#chat input[name=key]");
if (chatKey) chatKey.value = sessionStorage.getItem("llmgw-key") || "";
</script></body></html>
"""
