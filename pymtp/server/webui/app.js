// pymtp's chat page: chats through this server's streaming /v1/chat/completions and
// colours every token by how it came (the "pymtp" field the request asks for, see
// pymtp/server/origins.py); a reasoning model's thinking goes in a fold of its own
// (thinking.js); stream.js reads the stream. Only relative URLs: the page talks to its
// own origin.
// Model text goes into the page with textContent only, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "pymtp.key";          // sessionStorage: this tab only, gone when it closes
  const ORIGIN_NAMES = {recovered: "recovered: the target's token at a rejected draft",
                        bonus: "bonus: the target's token after every draft was accepted",
                        decoded: "decoded: a round without drafts",
                        predicted: "predicted: a token of the request's prediction the target kept"};

  let history = [];                 // the conversation sent with each request
  let controller = null;            // aborts the running request
  let chat = 0;                     // which conversation: "New chat" starts the next one
  let polling = null;

  // ------------------------------------------------------------------ HTTP
  function storedKey() {
    try {
      return sessionStorage.getItem(KEY);
    } catch {                       // storage blocked for the site: no key kept, no key sent
      return null;
    }
  }

  function headers() {
    const h = {"Content-Type": "application/json"};
    const key = storedKey();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function getJSON(path) {
    const r = await fetch(path, {headers: headers()});
    if (r.status === 401) throw new NeedKey();
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  class NeedKey extends Error {        // a 401: the reply's note says so (it said "Error")
    constructor() {
      super(storedKey() ? "the server refused the API key: enter the right one above"
                        : "this server needs an API key: enter it above");
    }
  }

  // ------------------------------------------------------------------ rendering
  function originClass(origin) {
    const m = /^d([0-9]+)$/.exec(origin);
    if (m) return "o-d" + Math.min(Number(m[1]), 4);
    return Object.hasOwn(ORIGIN_NAMES, origin) ? "o-" + origin : "o-plain";
  }

  function originTitle(origin) {
    const m = /^d([0-9]+)$/.exec(origin);
    if (m) return `accepted draft, position ${m[1]}`;
    return ORIGIN_NAMES[origin] || "no origin sent";
  }

  // The one place model text enters the page: as a text node inside a span.
  function appendPiece(body, text, origin) {
    const span = document.createElement("span");
    span.className = "tok " + originClass(origin);
    span.dataset.origin = origin || "";
    span.title = originTitle(origin);
    span.textContent = text;
    body.appendChild(span);
  }

  function addMessage(role, text) {
    const msg = document.createElement("div");
    msg.className = "msg " + role;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role;
    const body = document.createElement("div");
    body.className = "body";
    body.textContent = text;
    msg.append(who);
    if (role === "assistant") {      // a reasoning model's thinking, apart (thinking.js)
      const thinking = document.createElement("details");
      thinking.className = "thinking";
      thinking.hidden = true;
      thinking.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "thinking";
      const thought = document.createElement("div");
      thought.className = "body";
      thinking.append(summary, thought);
      msg.append(thinking);
    }
    msg.append(body);
    $("transcript").appendChild(msg);
    msg.scrollIntoView({block: "end"});
    return msg;
  }

  function bars(el, rows) {        // rows: [label, value 0..1, text]
    el.replaceChildren(...rows.map(([label, frac, text]) => {
      const row = document.createElement("div");
      row.className = "bar-row";
      const name = document.createElement("span");
      name.className = "bar-label";
      name.textContent = label;
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.className = "fill";
      fill.style.width = `${Math.round(Math.max(0, Math.min(1, frac)) * 100)}%`;
      bar.appendChild(fill);
      const value = document.createElement("span");
      value.className = "bar-value";
      value.textContent = text;
      row.append(name, bar, value);
      return row;
    }));
  }

  const pct = (x) => `${Math.round(x * 100)}%`;

  function depthBars(el, depths) {           // {depth: rounds}
    const entries = Object.entries(depths).sort((a, b) => Number(a[0]) - Number(b[0]));
    const all = entries.reduce((s, [, n]) => s + n, 0);
    bars(el, entries.map(([k, n]) => [`k=${k}`, all ? n / all : 0, String(n)]));
  }

  // ------------------------------------------------------------------ one reply's numbers (reply.js counts)
  function showTally(t, serverTps) {
    $("r-tokens").textContent = String(t.tokens);
    const secs = t.tFirst === null ? 0 : (performance.now() - t.tFirst) / 1000;
    const tps = serverTps ?? (secs > 0 && t.tokens > 1 ? (t.tokens - 1) / secs : null);
    $("r-tps").textContent = tps === null ? "–" : tps.toFixed(1);
    $("r-rounds").textContent = String(t.rounds);
    $("r-per-round").textContent = t.rounds ? ((t.accepted + t.rounds) / t.rounds).toFixed(2) : "–";
    $("r-accepted").textContent = `${t.accepted} / ${t.drafted}`;
    bars($("r-positions"), t.draftedAt.map((d, i) =>
      [`d${i + 1}`, d ? t.acceptedAt[i] / d : 0, `${t.acceptedAt[i]}/${d}`]));
    depthBars($("r-depths"), t.depths);
  }

  // ------------------------------------------------------------------ a request
  function requestSettings() {           // the settings' raw texts, for reply.js's requestBody
    const number = (id) => [$(id).value, $(id).validity.badInput];
    return {max_tokens: number("max-tokens"), temperature: number("temperature"), top_k: number("top-k"),
            top_p: number("top-p"), min_p: number("min-p"), seed: number("seed"),
            draft_max: $("draft-max").value, spec: $("spec").value};
  }

  function atBottom() {
    // the reader follows the reply only while at the end of the page: one who scrolled
    // up to read stays there
    return window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 40;
  }

  async function send(text) {
    const mine = chat;
    const system = $("system").value.trim();
    const messages = [...(system ? [{role: "system", content: system}] : []), ...history,
                      {role: "user", content: text}];
    addMessage("user", text);
    const msg = addMessage("assistant", "");
    const body = msg.querySelector(":scope > .body");
    const thinking = msg.querySelector(".thinking");
    const thought = thinking.querySelector(".body");
    msg.dataset.state = "streaming";
    const tally = new Tally();
    let split = null;          // made at the first traced chunk, which says how the server splits
    let answering = false;     // the reply's content has begun
    const draw = (pieces) => {
      const follow = atBottom();
      for (const [where, text, origin] of pieces) {
        if (where === "thinking") thinking.hidden = false;
        else if (!answering) {             // the answer has begun: fold the thinking away, once
          answering = true;                // (a reader who opens it again keeps it open)
          thinking.open = false;
        }
        appendPiece(where === "thinking" ? thought : body, text, origin);
      }
      if (follow) msg.scrollIntoView({block: "end"});
    };
    let reply = "";
    controller = new AbortController();
    busy(true);
    try {
      const r = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
        body: JSON.stringify(requestBody(messages, requestSettings())), signal: controller.signal});
      if (r.status === 401) throw new NeedKey();
      if (!r.ok) {
        const err = await r.json().catch(() => null);
        throw new Error(err?.error?.message || `HTTP ${r.status}`);
      }
      let serverTps = null;
      let traced = false;      // the chunks' pymtp pieces draw the text (thinking included)
      for await (const obj of sseEvents(r)) {
        if (obj.error) throw new Error(obj.error.message || "the server ended the stream");
        const choice = obj.choices && obj.choices[0];
        const text = choice?.delta?.content ?? "";
        if (obj.pymtp) {
          traced = true;
          tally.add(obj.pymtp);
          split = split || new ThinkingSplit(obj.pymtp.thinking);
          for (const [piece, origin] of obj.pymtp.pieces) draw(split.feed(piece, origin));
        } else if (!traced) {
          if (choice?.delta?.reasoning_content) draw([["thinking", choice.delta.reasoning_content, null]]);
          if (text) draw([["content", text, null]]);
        }
        reply += text;
        if (obj.timings) serverTps = obj.timings.predicted_per_second;
        showTally(tally, serverTps);
      }
      if (split) draw(split.finish());
      msg.dataset.state = "done";
    } catch (e) {
      if (split) draw(split.finish());      // what was held back of the reply so far
      msg.dataset.state = e.name === "AbortError" ? "stopped" : "error";
      if (e instanceof NeedKey) askKey();
      const note = document.createElement("div");
      note.className = "error";
      note.textContent = e.name === "AbortError" ? "stopped" : String(e.message || e);
      msg.appendChild(note);
    } finally {
      // a reply of a conversation that "New chat" ended does not come back into the new one
      const kept = conversationAfter(messages, reply, msg.dataset.state);
      if (kept && mine === chat) history = kept;
      controller = null;
      busy(false);
    }
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    $("status").textContent = on ? "generating…" : "";
  }

  // ------------------------------------------------------------------ server panel
  async function pollStats() {
    if (document.hidden) return;
    let s;
    try {
      s = await getJSON("pymtp/stats");
    } catch (e) {
      if (e instanceof NeedKey) askKey();
      return;
    }
    $("s-slots").textContent = `${s.slots.busy} / ${s.slots.total}`;
    $("s-queue").textContent = `${s.queue.waiting} / ${s.queue.max}`;
    $("s-generations").textContent = String(s.generations);
    $("s-tps").textContent = s.tokens_per_second ? s.tokens_per_second.toFixed(1) : "–";
    $("s-per-round").textContent = s.rounds ? s.mean_tokens_per_round.toFixed(2) : "–";
    $("s-acceptance").textContent = s.drafted ? `${pct(s.acceptance_rate)} of ${s.drafted}` : "–";
    $("s-batch").textContent = s.batch ? s.batch.mean_batch_size.toFixed(2) +
      (s.batch.engines > 1 ? ` in each of ${s.batch.engines} engines` : "") : "–";
    bars($("s-positions"), s.drafted_at.map((d, i) =>
      [`d${i + 1}`, d ? s.accepted_at[i] / d : 0, `${s.accepted_at[i]}/${d}`]));
    depthBars($("s-depths"), s.depths);
  }

  // ------------------------------------------------------------------ start
  function askKey() {
    clearInterval(polling);
    polling = null;
    $("key-form").hidden = false;
    $("model").textContent = storedKey() ? "the API key was refused" : "needs an API key";
    $("key").focus();
  }

  async function connect() {
    let models;
    try {
      models = await getJSON("v1/models");
    } catch (e) {
      if (e instanceof NeedKey) askKey();
      else {                      // a server restarting or not yet up: try again, as it says
        $("model").textContent = `${String(e.message || e)} (trying again)`;
        setTimeout(connect, 3000);
      }
      return;
    }
    $("key-form").hidden = true;
    const card = models.data[0];
    $("model").textContent = card.id;
    const meta = card.meta || {};
    const select = $("draft-max");
    select.querySelectorAll("option.depth").forEach((o) => o.remove());
    for (let k = 1; k <= (meta.draft_limit || 0); k++) {     // no drafts: Decoding "none"
      const o = document.createElement("option");
      o.className = "depth";
      o.value = String(k);
      o.textContent = String(k);
      select.appendChild(o);
    }
    if (meta.draft_max !== undefined) select.options[0].textContent = `server default (${meta.draft_max})`;
    $("model").dataset.ready = "true";
    await pollStats();
    if (polling === null) polling = setInterval(pollStats, 1000);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      try {
        sessionStorage.setItem(KEY, $("key").value);
      } catch {
        $("model").textContent = "this browser keeps no key for the site (storage is blocked)";
        return;
      }
      $("key").value = "";
      connect();
    });
    $("compose").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      // Enter that confirms an input method's composition (Japanese, Chinese ...) is not a send
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
        ev.preventDefault();
        $("compose").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      chat += 1;                 // a reply still running ends apart from the new conversation
      if (controller) controller.abort();
      history = [];
      $("transcript").replaceChildren();
    });
    connect();
  });
})();
