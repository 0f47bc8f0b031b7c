"use strict";
// Shared by the tutor page and the chat page: the API key (kept for the tab's session), the
// OpenAI-style error body, and reading a Server-Sent Events stream from fetch().
const api = {
  key: sessionStorage.getItem("tutorserve-key") || "",

  setKey(key) {
    this.key = key;
    sessionStorage.setItem("tutorserve-key", key);
  },

  headers() {
    const h = { "Content-Type": "application/json" };
    if (this.key) h.Authorization = "Bearer " + this.key;
    return h;
  },

  async errorText(resp) {
    try { return (await resp.json()).error.message; } catch { return resp.statusText; }
  },

  // Calls onEvent(name, data) for each event; name is "message" when the event has none.
  async readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const name = (block.match(/^event: (.*)$/m) || [])[1] || "message";
        const data = (block.match(/^data: (.*)$/m) || [])[1];
        if (data !== undefined) onEvent(name, data);
      }
    }
  },
};
