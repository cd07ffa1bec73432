// The chat page's request from its settings, and its count of one reply's rounds. No DOM
// here, so tests run it under node (tests/server/test_webui_reply.py).
"use strict";

(() => {
  // A setting's number as typed, for the server to check (a bad one comes back as its 400
  // naming the field): "1e3" is 1000 and "2.9" stays 2.9 (parseInt made them 1 and 2). A
  // field the browser cannot read as a number (badInput: "0,7" in a locale that writes
  // "0.7") is an error here, since it reads as empty and the server's default would be used.
  function settingNumber(name, raw, badInput) {
    if (badInput) throw new Error(`${name} is not a number: correct the field or clear it`);
    const v = raw.trim();
    return v === "" ? undefined : Number(v);
  }

  // settings: {max_tokens, temperature, top_k, top_p, min_p, seed: [text, badInput],
  // draft_max: "" | "auto" | "N", spec: "" | name}; blank ones are left to the server.
  function requestBody(messages, settings) {
    const body = {messages, stream: true, pymtp: {origins: true}};
    for (const name of ["max_tokens", "temperature", "top_k", "top_p", "min_p", "seed"]) {
      const v = settingNumber(name, ...settings[name]);
      if (v !== undefined) body[name] = v;
    }
    const k = settings.draft_max;
    if (k !== "") body.draft_max = k === "auto" ? "auto" : Number(k);
    if (settings.spec) body.spec = settings.spec;
    return body;
  }

  // One reply's numbers from its chunks' "pymtp" fields, each one verify round.
  class Tally {
    constructor() {
      this.tokens = 0; this.rounds = 0; this.drafted = 0; this.accepted = 0;
      this.draftedAt = []; this.acceptedAt = []; this.depths = {};
      this.chunks = 0; this.tFirst = null;
    }

    add(ext) {
      // a chunk with no tokens (the last one, where the context filled) is no round: it
      // showed as a depth-0 round the server's stats do not have
      if (ext.tokens.length === 0) return;
      if (this.tFirst === null) this.tFirst = performance.now();
      this.tokens += ext.tokens.length;
      const first = this.chunks++ === 0;           // the prompt's first token, not a round
      if (ext.predicted) return;                   // drafts from the request's prediction, not the head's
      if (!first || ext.drafted > 0) this.depths[ext.drafted] = (this.depths[ext.drafted] || 0) + 1;
      if (ext.drafted === 0) return;
      this.rounds += 1;
      this.drafted += ext.drafted;
      this.accepted += ext.accepted;
      for (let i = 0; i < ext.drafted; i++) {
        this.draftedAt[i] = (this.draftedAt[i] || 0) + 1;
        this.acceptedAt[i] = (this.acceptedAt[i] || 0) + (i < ext.accepted ? 1 : 0);
      }
    }
  }

  globalThis.requestBody = requestBody;
  globalThis.Tally = Tally;
})();
