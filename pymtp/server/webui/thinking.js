// A streamed reply's coloured pieces split into thinking and content, as the server splits
// its text (pymtp/reasoning.py): the reply's leading <think>...</think> block is thinking,
// the rest content, the white space before the thinking and after the end tag dropped. The
// server says how it splits this reply (each chunk's "pymtp".thinking): null, it does not;
// "opened", the prompt opened the block, so the reply starts inside it; "written", the
// reply may open one itself. No DOM here, so tests run it under node
// (tests/server/test_webui_thinking.py).
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
    // mode: the server's "pymtp".thinking (null, "opened" or "written")
    constructor(mode) {
      this.split = mode === "opened" || mode === "written";
      // start (an open tag may come), lead (inside, white space skipped), inside,
      // after (white space after the end tag skipped), content
      this.state = mode === "opened" ? "lead" : "start";
      this.held = "";           // text held back: it may be the start of a tag
      this.heldOrigin = null;
    }

    // One piece: [where, text, origin] triples, where is "thinking" or "content".
    feed(text, origin) {
      if (!this.split || this.state === "content") return text ? [["content", text, origin]] : [];
      const all = this.held + text;
      const from = this.held ? this.heldOrigin : origin;
      this.held = "";
      if (this.state === "after" || this.state === "lead") {
        const rest = all.replace(/^\s+/, "");
        if (!rest) return [];
        if (this.state === "after") {
          this.state = "content";
          return [["content", rest, origin]];
        }
        return this.enter(rest, origin);
      }
      if (this.state === "start") {
        const rest = all.replace(/^\s+/, "");
        if (rest.startsWith(OPEN)) {
          this.state = "lead";
          return this.feed(rest.slice(OPEN.length), origin);
        }
        if (OPEN.startsWith(rest)) return this.hold(all, from);      // white space, or a piece of the tag
        this.state = "content";         // no block: the reply is all content, white space kept
        return [["content", all, from]];
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

    // The end of the reply (or of what came of it): what is still held, where the server
    // puts it.
    finish() {
      const held = this.held;
      this.held = "";
      if (!held || this.state === "after") return [];
      return [[this.state === "inside" || this.state === "lead" ? "thinking" : "content", held, this.heldOrigin]];
    }
  }

  globalThis.ThinkingSplit = ThinkingSplit;
})();
