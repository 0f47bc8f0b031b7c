"use strict";
// Shared by the tutor page and the chat page: the API key (kept for the tab's session), the
// OpenAI-style error body, and reading a Server-Sent Events stream from fetch().
const api = {
  key: sessionStorage.getItem("tutorserve-key") || "",

  setKey(key) {
    this.key = key;
    sessionStorage.setItem("tutorserve-key", key);
  },

  headers(json = true) {  // false for a FormData body: the browser sets its multipart boundary
    const h = json ? { "Content-Type": "application/json" } : {};
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

// The tutor page's voice: the microphone (push-to-talk, or hands-free until a pause) and a
// queue that plays the reply's sentences one after another as they arrive.
const voice = {
  // Starts recording; resolves to { stop(): Promise<Blob> }. With `untilSilence`, `onSilence`
  // fires once speech has been heard and then `silenceMs` of quiet.
  async record({ untilSilence = false, silenceMs = 900, onSilence = null } = {}) {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const type = MediaRecorder.isTypeSupported("audio/webm;codecs=opus") ? "audio/webm;codecs=opus" : "";
    const rec = new MediaRecorder(stream, type ? { mimeType: type } : {});
    const parts = [];
    rec.ondataavailable = (e) => { if (e.data.size) parts.push(e.data); };
    rec.start(250);
    let ctx = null, timer = null;
    if (untilSilence) {
      ctx = new AudioContext();
      const analyser = ctx.createAnalyser();
      analyser.fftSize = 1024;
      ctx.createMediaStreamSource(stream).connect(analyser);
      const buf = new Float32Array(analyser.fftSize);
      let spoke = false, quietSince = performance.now();
      timer = setInterval(() => {
        analyser.getFloatTimeDomainData(buf);
        const rms = Math.sqrt(buf.reduce((a, x) => a + x * x, 0) / buf.length);
        const now = performance.now();
        if (rms > 0.02) { spoke = true; quietSince = now; }
        else if (spoke && now - quietSince > silenceMs && onSilence) { onSilence(); onSilence = null; }
      }, 50);
    }
    return {
      stop() {
        return new Promise((resolve) => {
          rec.onstop = () => {
            clearInterval(timer);
            if (ctx) ctx.close();
            for (const t of stream.getTracks()) t.stop();
            resolve(new Blob(parts, { type: rec.mimeType || "audio/webm" }));
          };
          rec.stop();
        });
      },
    };
  },

  // Plays base64 WAVs in order; `clear()` stops at once (the tutor's reply was reset);
  // `whenIdle(fn)` calls fn once nothing is left to play.
  player(onPlay) {
    const queue = [];
    let current = null, idle = null;
    const next = () => {
      if (!current && !queue.length && idle) { const fn = idle; idle = null; fn(); }
      if (current || !queue.length) return;
      current = new Audio(queue.shift());
      const done = () => { URL.revokeObjectURL(current.src); current = null; next(); };
      current.onended = done;
      current.onerror = done;
      current.play().then(() => onPlay && onPlay(), done);
    };
    return {
      add(b64) {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        queue.push(URL.createObjectURL(new Blob([bytes], { type: "audio/wav" })));
        next();
      },
      clear() {
        queue.length = 0;
        if (current) { current.pause(); URL.revokeObjectURL(current.src); current = null; }
      },
      whenIdle(fn) { idle = fn; next(); },
    };
  },
};
