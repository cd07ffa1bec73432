// A streamed reply's coloured pieces split into thinking and content, as the server splits
// its text (pymtp/reasoning.py): the reply's leading <think>...</think> block is thinking,
// the rest content, the white space after the end tag dropped. The server says whether it
// splits this reply: a delta with reasoning_content before any with content. Until it has
// said, pieces wait. No DOM here, so tests run it under node (tests/server/test_webui_thinking.py).
"use strict";

(() => {
  const OPEN = "<think>", CLOSE = "</think>";

  // the length of the longest suffix of text that is a proper prefix of tag
  function partial(text, tag) {
    for (let n = Math.min(tag.length - 1, text.length); n > 0; n--) {
      if (text.endsWith(tag.slice(0, n))) return n;
    }
    return 0;
  }

  class ThinkingSplit {
    constructor() {
      this.split = null;        // null: not known yet; true: the server splits; false: it does not
      this.waiting = [];        // [text, origin] before it is known
      this.state = "start";     // start (an open tag may come), inside, after (white space skipped), content
      this.held = "";           // text held back: it may be the start of a tag
      this.heldOrigin = null;
    }

    // A delta's fields: returns the waiting pieces once the server has said.
    decide(delta) {
      if (this.split !== null || !delta) return [];
      if (delta.reasoning_content) this.split = true;
      else if (delta.content) this.split = false;
      else return [];
      const waiting = this.waiting;
      this.waiting = [];
      return waiting.flatMap(([text, origin]) => this.feed(text, origin));
    }

    // One piece: [where, text, origin] triples, where is "thinking" or "content".
    feed(text, origin) {
      if (this.split === null) {
        this.waiting.push([text, origin]);
        return [];
      }
      if (!this.split || this.state === "content") return text ? [["content", text, origin]] : [];
      const all = this.held + text;
      const from = this.held ? this.heldOrigin : origin;
      this.held = "";
      if (this.state === "after") {
        const rest = all.replace(/^\s+/, "");
        if (!rest) return [];
        this.state = "content";
        return [["content", rest, origin]];
      }
      if (this.state === "start") {
        const rest = all.replace(/^\s+/, "");
        if (rest.startsWith(OPEN)) return this.enter(rest.slice(OPEN.length), origin);
        if (OPEN.startsWith(rest)) return this.hold(rest, from);      // "" or a piece of the tag
        return this.enter(rest, origin);
      }
      const at = all.indexOf(CLOSE);
      if (at >= 0) {
        this.state = "after";
        const out = at > 0 ? [["thinking", all.slice(0, at), from]] : [];
        return out.concat(this.feed(all.slice(at + CLOSE.length), origin));
      }
      const keep = partial(all, CLOSE);
      const out = all.length > keep ? [["thinking", all.slice(0, all.length - keep), from]] : [];
      if (keep) this.hold(all.slice(all.length - keep), origin);
      return out;
    }

    enter(text, origin) {
      this.state = "inside";
      return this.feed(text, origin);
    }

    hold(text, origin) {
      this.held = text;
      this.heldOrigin = origin;
      return [];
    }

    // The end of the reply: what still waits or is held, as the server hands it over.
    finish() {
      if (this.split === null) {
        this.split = false;
        const waiting = this.waiting;
        this.waiting = [];
        return waiting.flatMap(([text, origin]) => this.feed(text, origin));
      }
      const held = this.held;
      this.held = "";
      if (!held || this.state === "after") return [];
      return [[this.state === "content" ? "content" : "thinking", held, this.heldOrigin]];
    }
  }

  globalThis.ThinkingSplit = ThinkingSplit;
})();
