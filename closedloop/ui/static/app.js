// closedloop ui: live refresh, the only script. It asks /api/version (one cheap query) every
// data-poll-ms; when the store changed, it fetches this same page again and swaps #content for
// the new one. The HTML comes from this server, already escaped; DOMParser runs no script.
(function () {
  "use strict";
  const body = document.body;
  if (body.dataset.live !== "1") return;
  const every = Math.max(50, parseInt(body.dataset.pollMs || "2000", 10));
  const status = document.getElementById("live-status");
  const toggle = document.getElementById("live-toggle");
  let refreshes = 0;

  function say(text) { if (status) status.textContent = text; }

  async function tick() {
    if (toggle && !toggle.checked) { say("paused"); return later(); }
    try {
      const r = await fetch("/api/version", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      const v = (await r.json()).version;
      if (v !== body.dataset.version) {
        const page = await fetch(location.href, { cache: "no-store" });
        if (!page.ok) throw new Error("HTTP " + page.status);
        const doc = new DOMParser().parseFromString(await page.text(), "text/html");
        const fresh = doc.getElementById("content");
        const current = document.getElementById("content");
        if (fresh && current) current.replaceWith(document.importNode(fresh, true));
        body.dataset.version = doc.body.dataset.version || v;
        refreshes += 1;
        body.dataset.refreshes = String(refreshes);
        if (doc.body.dataset.live !== "1") { body.dataset.live = "0"; say("finished"); return; }
      }
      say("live · checked " + new Date().toLocaleTimeString());
    } catch (e) {
      say("live · store not reachable (" + e.message + "), retrying");
    }
    later();
  }

  function later() { setTimeout(tick, every); }
  later();
})();
