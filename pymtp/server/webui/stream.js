// The chat page's reading of a streamed reply and what the conversation keeps of it. No
// DOM here, so tests run it under node on real streams of the chat route
// (tests/server/test_webui_stream.py).
"use strict";

(() => {
  // The JSON objects of a server-sent-events response, in order: data: frames separated by
  // blank lines (CRLF, CR or LF), ending at [DONE]. A stream that closes before [DONE] (the
  // server or a proxy cut it) throws after what came, so a cut reply never passes for a
  // whole one.
  async function* sseEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";          // text not yet split into frames, its line ends made LF
    let cr = false;        // the last text read ended in a CR, which may be half of a CRLF
    for (;;) {
      const {value, done} = await reader.read();
      if (done) throw new Error("the stream ended before the reply did (the connection was closed)");
      let text = decoder.decode(value, {stream: true});
      if (!text) continue;              // half a character: nothing read yet
      if (cr && text.startsWith("\n")) text = text.slice(1);    // that CRLF's LF: its line has ended
      cr = text.endsWith("\r");        // false after a read of that LF alone (a later LF is a line end)
      buf += text.replace(/\r\n?/g, "\n");      // CRLF, CR and LF all end a line
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  // The conversation after a reply: the request's turns (its system message apart, which
  // the page sends afresh each time) and the reply as far as it went. A reply that ended
  // ("done") or that the reader stopped with some text ("stopped") stays, as it stays on
  // screen; an error, or a stop before any text, leaves the conversation as it was (null).
  function conversationAfter(messages, reply, outcome) {
    if (outcome === "error" || (outcome === "stopped" && !reply)) return null;
    return [...messages.filter((m) => m.role !== "system"), {role: "assistant", content: reply}];
  }

  globalThis.sseEvents = sseEvents;
  globalThis.conversationAfter = conversationAfter;
})();
