/* petals-chain swarm dashboard.
 * Polls the relative URL api/v1/swarm (so the page works under the orchestrator at "/" and under the
 * standalone dashboard) and re-renders in place. Every string from the API is untrusted (public swarm
 * names): it only ever reaches the DOM through textContent / setAttribute, never as HTML markup. */
(function () {
  "use strict";

  // Several models behind one orchestrator: the page shows the one named by ?model= (the API routes by it).
  var MODEL = new URLSearchParams(window.location.search).get("model");
  var API_URL = "api/v1/swarm" + (MODEL ? "?model=" + encodeURIComponent(MODEL) : "");
  var SVGNS = "http://www.w3.org/2000/svg";
  var GONE_KEEP_MS = 10 * 60 * 1000; // how long a departed server stays listed as "gone"
  // ... and at most this many, the latest to leave: peers whose ids change at every poll grew the list (and the
  // table) without bound within those 10 minutes
  var GONE_KEEP_MAX = 50;
  // The departures left out are remembered by peer id only, so that one that comes back is no longer counted (per-poll
  // counts kept counting servers online again); at most this many, the latest: beyond, the count is a lower bound
  var GONE_COUNT_MAX = 10000;
  var QUEUE_SAMPLES = 120;

  var state = {
    periodS: 2,
    timer: null,
    inFlight: null,
    present: new Map(), // peer_id -> server object from the latest response
    gone: new Map(), // peer_id -> {server, since (ms)}, the oldest departure first
    goneDropped: new Map(), // peer_id -> since (ms) of the departures left out for GONE_KEEP_MAX, the oldest first
    goneForgottenUntil: 0, // ms: until then, departures beyond GONE_COUNT_MAX were forgotten (the count is a floor)
    queueSamples: [], // [{t (ms), q, running}]
    last: null,
    lastOkAt: null,
    version: "", // the orchestrator's build (data.version)
  };

  // ---------- small helpers ----------
  function $(id) { return document.getElementById(id); }

  function el(tag, attrs) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    for (var i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  }

  function svg(tag, attrs) {
    var node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    for (var i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    Object.keys(attrs).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === "text") node.textContent = str(v);
      else if (k === "class") node.setAttribute("class", str(v));
      else if (k === "style") Object.keys(v).forEach(function (p) { node.style.setProperty(p, str(v[p])); });
      else node.setAttribute(k, str(v));
    });
  }

  function append(node, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) { child.forEach(function (c) { append(node, c); }); return; }
    if (typeof child === "string" || typeof child === "number") node.appendChild(document.createTextNode(String(child)));
    else node.appendChild(child);
  }

  function str(x) {
    if (x === null || x === undefined) return "";
    if (typeof x === "string") return x;
    if (typeof x === "number" || typeof x === "boolean") return String(x);
    try { return JSON.stringify(x); } catch (e) { return "?"; }
  }

  /** A finite number or null: API fields may be missing, null or (from a hostile peer) of the wrong type. */
  function num(x) {
    var n = typeof x === "number" ? x : (typeof x === "string" && x.trim() !== "" ? Number(x) : NaN);
    return isFinite(n) ? n : null;
  }

  function int(x) { var n = num(x); return n === null ? null : Math.round(n); }
  function clamp(x, lo, hi) { return Math.max(lo, Math.min(hi, x)); }
  function arr(x) { return Array.isArray(x) ? x : []; }
  function obj(x) { return x && typeof x === "object" && !Array.isArray(x) ? x : {}; }

  function fmtSeconds(s) {
    var v = num(s);
    if (v === null) return "\u2014";
    if (v === 0) return "0";
    if (v < 0.001) return (v * 1e6).toFixed(0) + " \u00b5s";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms";
    if (v < 100) return v.toFixed(2) + " s";
    return v.toFixed(0) + " s";
  }

  /** Axis labels: three significant digits at most. */
  function fmtAxis(s) {
    var v = num(s);
    if (v === null) return "";
    if (v === 0) return "0";
    if (v < 1) return Number((v * 1000).toPrecision(3)) + " ms";
    return Number(v.toPrecision(3)) + " s";
  }

  function fmtTokens(n) {
    if (n === null) return "?";
    return n >= 10000 ? Number((n / 1000).toPrecision(3)) + "k" : String(n);
  }

  function fmtBytes(b) {
    var v = num(b);
    if (v === null) return "\u2014";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }

  function fmtAgo(t, nowS) {
    var v = num(t);
    if (v === null) return "\u2014";
    var d = Math.max(0, nowS - v);
    if (d < 1) return "just now";
    if (d < 90) return d.toFixed(0) + " s ago";
    if (d < 5400) return (d / 60).toFixed(0) + " min ago";
    return (d / 3600).toFixed(1) + " h ago";
  }

  function fmtClock(tS) {
    var d = new Date(tS * 1000);
    function p(n) { return (n < 10 ? "0" : "") + n; }
    return p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
  }

  function shortId(id) {
    var s = str(id);
    return s.length > 14 ? s.slice(0, 6) + "\u2026" + s.slice(-6) : s;
  }

  // the build a server runs (its record's version: petals-chain/<package>[+g<commit>[.dirty]]) and its wire
  // protocols; marked when it is not the orchestrator's build, so volunteers on old code stand out
  function versionLine(s, ours) {
    var v = str(s.version);
    if (!v) return null;
    var p = int(s.protocol), pmin = int(s.protocol_min);
    var proto = p === null ? "" : "wire protocol " + (pmin !== null && pmin < p ? pmin + ".." + p : p);
    var differs = !!ours && v !== ours;
    var title = v + (proto ? "\n" + proto : "") + (differs ? "\nthe orchestrator runs " + ours : "");
    return el("div", { class: "version" + (differs ? " version-differs" : ""), title: title,
      text: v.indexOf("petals-chain/") === 0 ? v.slice("petals-chain/".length) : v });
  }

  function serverName(s) {
    var name = str(s.public_name).trim();
    return name || shortId(s.peer_id);
  }

  /** Offline (announced or record expired) and failed (the orchestrator lost it) servers count as gone. */
  function isLive(s) { return !!s && s.state !== "offline" && s.state !== "failed"; }

  // ---------- refresh loop ----------
  function readInitialPeriod() {
    var fromQuery = null;
    try { fromQuery = new URLSearchParams(window.location.search).get("refresh"); } catch (e) { /* old browser */ }
    var v = num(fromQuery);
    if (v === null) {
      try { v = num(window.localStorage.getItem("petals-chain.refresh")); } catch (e) { v = null; }
    }
    // 0 pauses; anything else is at least 1 s (a crafted ?refresh=0.0001 made every visitor poll 10 times a second)
    return v === null ? 2 : (v <= 0 ? 0 : clamp(v, 1, 3600));
  }

  function setPeriod(seconds, persist) {
    state.periodS = seconds;
    var select = $("refresh-select");
    var value = String(seconds);
    if (!Array.prototype.some.call(select.options, function (o) { return o.value === value; })) {
      select.appendChild(el("option", { value: value, text: value + " s" }));
    }
    select.value = value;
    if (persist) {
      try { window.localStorage.setItem("petals-chain.refresh", value); } catch (e) { /* private mode */ }
    }
    schedule(0);
  }

  function schedule(delayMs) {
    if (state.timer !== null) { clearTimeout(state.timer); state.timer = null; }
    if (delayMs === 0 || state.periodS > 0) state.timer = setTimeout(poll, delayMs);
  }

  function poll() {
    state.timer = null;
    if (state.inFlight) return; // the in-flight request reschedules when it ends
    var startedAt = Date.now();
    var ctrl = typeof AbortController === "function" ? new AbortController() : null;
    var timeoutMs = Math.max(5000, state.periodS * 2000);
    var killer = ctrl ? setTimeout(function () { ctrl.abort(); }, timeoutMs) : null;
    state.inFlight = fetch(API_URL, { cache: "no-store", headers: { Accept: "application/json" }, signal: ctrl ? ctrl.signal : undefined })
      .then(function (resp) {
        if (resp.ok) return resp.json();
        // the API's own word on why (a standalone dashboard that has not read the swarm yet), if it gave one
        return resp.json().then(function (body) { return str(obj(obj(body).error).message); },
          function () { return ""; })
          .then(function (why) { throw new Error("HTTP " + resp.status + (why ? ": " + why.slice(0, 300) : "")); });
      })
      .then(function (data) {
        state.lastOkAt = Date.now();
        showError(null);
        render(obj(data));
      })
      .catch(function (err) {
        showError("Cannot reach the swarm API (" + (err && err.name === "AbortError" ? "timed out" : str(err && err.message)) +
          "); retrying every " + Math.max(state.periodS, 1) + " s." +
          (state.last ? " Showing the last data received." : ""));
      })
      .then(function () {
        if (killer) clearTimeout(killer);
        state.inFlight = null;
        // Keep a fixed cadence: the next poll is one period after this one started, not after it ended.
        if (state.periodS > 0) schedule(Math.max(100, state.periodS * 1000 - (Date.now() - startedAt)));
      });
  }

  function showError(msg) {
    var banner = $("conn-error");
    // the same text is not set again: the banner is an alert, and a screen reader re-reads every change
    if (msg) { if (banner.textContent !== msg) banner.textContent = msg; banner.hidden = false; }
    else { banner.textContent = ""; banner.hidden = true; }
  }

  // ---------- rendering ----------
  function render(data) {
    var nowMs = Date.now();
    var servers = arr(data.servers).filter(function (s) { return s && typeof s === "object" && s.peer_id !== undefined; });
    trackDepartures(servers, nowMs);
    state.last = data;
    var running = arr(data.chains).reduce(function (a, c) { return a + (int(obj(c).active) || 0); }, 0);
    var q = int(data.queue_length);
    state.queueSamples.push({ t: nowMs, q: q === null ? 0 : q, running: running });
    if (state.queueSamples.length > QUEUE_SAMPLES) state.queueSamples.shift();

    renderHeader(data);
    renderCards(data, running);
    renderBounds(data);
    renderLatencyChart(data);
    renderChains(data);
    renderCoverage(data, servers);
    renderServers(data, servers, nowMs);
    renderClients(data);
    renderSchedule(data);
    renderGroups(data);
    renderModels(data);
  }

  // The models this orchestrator serves (several: one link each, the shown one marked).
  function renderModels(data) {
    var models = arr(data.models).filter(function (m) { return m && typeof m === "object" && m.name; });
    var nav = $("models-nav");
    nav.hidden = models.length < 2;
    if (models.length < 2) return;
    var shown = str(data.model_name);
    var links = models.map(function (m) {
      var name = str(m.name);
      // the name isolated: a right-to-left override in it reversed the counts after it
      var label = [el("bdi", { text: name }), " \u00b7 " + (int(m.servers) || 0) + " servers \u00b7 " +
        (int(m.chains) || 0) + " chains \u00b7 " + (int(m.queue_length) || 0) + " queued"];
      if (name === shown) {
        return el("span", { class: "model-link current", "data-model": name, "aria-current": "page" }, label);
      }
      return el("a", { class: "model-link", "data-model": name, href: "?model=" + encodeURIComponent(name) }, label);
    });
    // servers offering several models: which one each serves is the placement's (seed 001)
    var pl = obj(data.model_placement);
    if (pl.policy) {
      links.push(el("span", { class: "muted placement", title: "placement of servers offering several models: policy, " +
        "how the unserved index is judged (analytic: M/M/C from the rates; simulated: the recent requests replayed), " +
        "replacement interval, servers moved so far", text: "placement " + str(pl.policy) +
        (pl.index ? " \u00b7 " + str(pl.index) + " index" : "") + " \u00b7 every " +
        fmtSeconds(pl.interval_s) + " \u00b7 " + (int(pl.moves) || 0) + " moves" }));
    }
    nav.replaceChildren.apply(nav, links);
  }

  function trackDepartures(servers, nowMs) {
    var seen = new Map();
    servers.forEach(function (s) { seen.set(str(s.peer_id), s); });
    state.present.forEach(function (s, id) {
      if (!seen.has(id) && !state.gone.has(id)) state.gone.set(id, { server: s, since: nowMs });
    });
    seen.forEach(function (s, id) { state.gone.delete(id); state.goneDropped.delete(id); });
    state.gone.forEach(function (g, id) { if (nowMs - g.since > GONE_KEEP_MS) state.gone.delete(id); });
    var ids = state.gone.keys(); // a Map keeps insertion order: the oldest departure first
    while (state.gone.size > GONE_KEEP_MAX) {
      var id = ids.next().value;
      state.goneDropped.set(id, state.gone.get(id).since);
      state.gone.delete(id);
    }
    var dropped = state.goneDropped.keys();
    while (state.goneDropped.size > GONE_COUNT_MAX) {
      var oldest = dropped.next().value;
      state.goneForgottenUntil = Math.max(state.goneForgottenUntil, state.goneDropped.get(oldest) + GONE_KEEP_MS);
      state.goneDropped.delete(oldest);
    }
    state.goneDropped.forEach(function (since, id) { if (nowMs - since > GONE_KEEP_MS) state.goneDropped.delete(id); });
    state.present = seen;
  }

  // Servers that left within GONE_KEEP_MS, are still gone and are not listed (GONE_KEEP_MAX): all left before the
  // listed ones.
  function goneNotListed() {
    return state.goneDropped.size;
  }

  function renderHeader(data) {
    $("model-name").textContent = str(data.model) || "(model unknown)";
    $("prefix").textContent = data.dht_prefix ? "\u00b7 DHT prefix " + str(data.dht_prefix) : "";
    // a standalone dashboard whose DHT reads fail serves its last view marked with its age: old data, not current
    var staleS = num(data.stale_s), stale = $("stale-warning");
    stale.hidden = staleS === null;
    var why = data.stale_error ? " (" + str(data.stale_error).slice(0, 300) + ")" : "";
    var staleText = staleS === null ? "" : "This data is " + fmtAgo(0, staleS).replace(" ago", "") + " old: the " +
      "dashboard cannot read the swarm from the DHT" + why + ". It updates when a read succeeds.";
    if (stale.textContent !== staleText) stale.textContent = staleText;
    var badge = $("ready-badge");
    var ready = data.ready === true;
    badge.textContent = staleS !== null ? "stale" : (ready ? "ready" : "not ready");
    badge.className = "badge " + (ready && staleS === null ? "badge-ok" : "badge-warn");
    badge.setAttribute("data-ready", ready ? "true" : "false");
    var updated = num(data.updated_at);
    $("updated").textContent = updated === null ? "" : "updated " + fmtClock(updated);
    var src = str(data.source);
    state.version = str(data.version);  // the orchestrator's build: servers on another are marked
    var orchVersion = state.version ? "orchestrator " + state.version + " \u00b7 " : "";
    $("footer-source").textContent = orchVersion + (src === "dht"
      ? (data.orchestrator_summary === false
        ? "standalone dashboard: signed server records from the DHT; no signed summary from a trusted orchestrator, so chains and queue are unknown"
        : "standalone dashboard: signed server records and the trusted orchestrator's signed summary from the DHT")
      : (src ? "source: " + src : "served by the orchestrator"));
  }

  function renderCards(data, running) {
    var ready = data.ready === true;
    var sr = $("status-ready");
    sr.textContent = ready ? "ready" : "not ready";
    sr.className = "card-value " + (ready ? "ok-text" : "warn-text");
    var epoch = int(data.epoch);
    $("status-epoch").textContent = epoch === null ? "" : "plan epoch " + epoch;
    var ml = int(data.max_length);
    $("max-length").textContent = ml === null ? "\u2014" : String(ml);
    var jt = obj(data.job_tokens), lhat = int(jt.value);
    // paged servers' chain capacities count jobs of L^ tokens (algorithms/token_budget.py)
    $("job-tokens").textContent = lhat === null ? "tokens per job"
      : "tokens per job \u00b7 expected L\u0302 " + lhat + (str(jt.mode) ? " (" + str(jt.mode) + ")" : "");
    var c = int(data.c);
    $("c-star").textContent = c === null ? "\u2014" : String(c);
    var pol = [str(data.placement_policy), str(data.dispatch_policy)].filter(Boolean).join(" + ");
    $("policies").textContent = pol ? "policy " + pol : "";
    var lam = num(data.arrival_rate);
    $("arrival-rate").textContent = lam === null ? "\u2014" : lam.toFixed(lam < 10 ? 3 : 1) + " /s";
    var rho = num(data.rho_bar);
    $("rho-bar").textContent = rho === null ? "" : "target load \u03c1\u0304 = " + rho.toFixed(2);
    var q = data.orchestrator_summary === false ? null : int(data.queue_length);
    $("queue-length").textContent = q === null ? "\u2014" : String(q);
    var cap = arr(data.chains).reduce(function (a, ch) { return a + (int(obj(ch).capacity) || 0); }, 0);
    $("jobs-running").textContent = "waiting \u00b7 " + running + " / " + cap + " running";
    renderSpark($("queue-spark"));
    var m = obj(data.measured);
    var done = int(m.completed), failed = int(m.failed), unserved = int(m.unserved), cancelled = int(m.cancelled);
    $("completed").textContent = done === null ? "\u2014" : String(done);
    // unserved: ended before holding a chain (refused, dropped while queued, the client gone); cancelled: stopped
    // while holding one (its client gone)
    $("failed").textContent = "completed \u00b7 " + (failed === null ? 0 : failed) + " failed" +
      (unserved ? " \u00b7 " + unserved + " unserved" : "") + (cancelled ? " \u00b7 " + cancelled + " cancelled" : "");
  }

  function renderSpark(container) {
    var samples = state.queueSamples;
    var w = 200, h = 28;
    var root = svg("svg", { viewBox: "0 0 " + w + " " + h, preserveAspectRatio: "none", role: "img", "aria-label": "queue length over recent refreshes" });
    var maxQ = samples.reduce(function (a, s) { return Math.max(a, s.q); }, 1);
    if (samples.length > 1) {
      var pts = samples.map(function (s, i) {
        return (i * w / (QUEUE_SAMPLES - 1)).toFixed(1) + "," + (h - 2 - (s.q / maxQ) * (h - 4)).toFixed(1);
      });
      root.appendChild(svg("polyline", { class: "spark-line", points: pts.join(" "), "vector-effect": "non-scaling-stroke" }));
    }
    container.replaceChildren(root);
  }

  function bounds(data) {
    var p = obj(data.predicted_response_s);
    var lo = num(p.lower), hi = num(p.upper);
    return { lower: lo, upper: hi };
  }

  function renderBounds(data) {
    var b = bounds(data);
    var m = obj(data.measured);
    var meas = num(m.mean_response_s);
    $("predicted").textContent = b.lower === null ? "\u2014"
      : fmtSeconds(b.lower) + " \u2013 " + (b.upper === null ? "\u221e" : fmtSeconds(b.upper));
    $("measured-response").textContent = fmtSeconds(meas);
    $("measured-wait").textContent = fmtSeconds(m.mean_wait_s);
    $("measured-service").textContent = fmtSeconds(m.mean_service_s);
    var relay = obj(data.relay), hit = num(relay.prompt_cache_hit_rate);
    $("prompt-cache").textContent = hit === null ? "\u2014"
      : (100 * hit).toFixed(0) + "% of " + fmtTokens(int(relay.prompt_tokens)) + " tok";
    var spec = obj(relay.speculative), per = num(spec.tokens_per_relay_step), acc = num(spec.acceptance_rate);
    $("tokens-per-step").textContent = per === null ? "\u2014"
      : per.toFixed(2) + (acc === null ? "" : " (" + (100 * acc).toFixed(0) + "% of drafts kept)");
    var legs = num(relay.legs_per_token);
    $("legs-per-token").textContent = legs === null ? "\u2014"
      : legs.toFixed(2) + (typeof relay.mode === "string" ? " (relay: " + relay.mode + ")" : "");

    var container = $("bounds-gauge");
    var w = Math.max(300, Math.min(1400, container.clientWidth || 600)), h = 46, pad = 10;
    var top = Math.max(b.upper || 0, b.lower || 0, meas || 0) * 1.15;
    var root = svg("svg", { viewBox: "0 0 " + w + " " + h, role: "img", "aria-label": "predicted response-time band and measured mean" });
    root.appendChild(svg("rect", { class: "cov-empty", x: pad, y: 10, width: w - 2 * pad, height: 12, rx: 6 }));
    if (top > 0) {
      var x = function (v) { return pad + (w - 2 * pad) * clamp(v / top, 0, 1); };
      if (b.lower !== null) {
        var x0 = x(b.lower), x1 = b.upper === null ? w - pad : x(b.upper);
        root.appendChild(svg("rect", { class: "band", x: x0, y: 6, width: Math.max(2, x1 - x0), height: 20 },
          svg("title", { text: "Theorem 3.7 bounds " + fmtSeconds(b.lower) + " \u2013 " + fmtSeconds(b.upper) })));
        root.appendChild(svg("line", { class: "bound", x1: x0, x2: x0, y1: 4, y2: 28 }));
        if (b.upper !== null) root.appendChild(svg("line", { class: "bound", x1: x1, x2: x1, y1: 4, y2: 28 }));
      }
      if (meas !== null) {
        var xm = x(meas);
        root.appendChild(svg("path", { class: "marker", d: "M" + (xm - 6) + ",2 L" + (xm + 6) + ",2 L" + xm + ",12 Z" },
          svg("title", { text: "measured mean " + fmtSeconds(meas) })));
        root.appendChild(svg("rect", { class: "marker", x: xm - 1.5, y: 8, width: 3, height: 16 }));
      }
      (w < 500 ? [0, 0.5, 1] : [0, 0.25, 0.5, 0.75, 1]).forEach(function (f) {
        root.appendChild(svg("text", { x: pad + (w - 2 * pad) * f, y: 42, "text-anchor": f === 0 ? "start" : (f === 1 ? "end" : "middle"),
          text: fmtAxis(top * f) }));
      });
    } else {
      root.appendChild(svg("text", { x: w / 2, y: 42, "text-anchor": "middle", text: "no prediction or measurement yet" }));
    }
    container.replaceChildren(root);
  }

  function renderLatencyChart(data) {
    var container = $("latency-chart");
    var hist = arr(data.history).map(obj).filter(function (p) { return num(p.t) !== null; });
    hist.sort(function (a, b) { return num(a.t) - num(b.t); });
    if (hist.length === 0) {
      container.replaceChildren(el("div", { class: "empty", text: "No completed requests yet: the chart fills in as jobs finish." }));
      return;
    }
    var width = Math.max(320, Math.min(1400, container.clientWidth || 800));
    var height = width < 500 ? 180 : 240;
    var left = 62, right = 10, top = 10, bottom = 24;
    var t0 = num(hist[0].t), t1 = num(hist[hist.length - 1].t);
    if (t1 - t0 < 1) { t0 -= 0.5; t1 += 0.5; }
    var b = bounds(data);
    var ymax = 0;
    hist.forEach(function (p) { ymax = Math.max(ymax, num(p.response_s) || 0, num(p.wait_s) || 0, num(p.service_s) || 0); });
    if (b.upper !== null && b.upper < ymax * 3) ymax = Math.max(ymax, b.upper);
    if (b.lower !== null) ymax = Math.max(ymax, b.lower);
    ymax = ymax > 0 ? ymax * 1.1 : 1;
    var X = function (t) { return left + (width - left - right) * (t - t0) / (t1 - t0); };
    var Y = function (v) { return top + (height - top - bottom) * (1 - clamp(v / ymax, 0, 1)); };
    var root = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": "response, waiting and service time per completed request" });
    for (var i = 0; i <= 4; i++) {
      var v = ymax * i / 4;
      root.appendChild(svg("line", { class: i === 0 ? "axis" : "grid-line", x1: left, x2: width - right, y1: Y(v), y2: Y(v) }));
      root.appendChild(svg("text", { x: left - 6, y: Y(v) + 4, "text-anchor": "end", text: fmtAxis(v) }));
    }
    var ticks = width < 500 ? 3 : 5;
    for (var j = 0; j <= ticks; j++) {
      var t = t0 + (t1 - t0) * j / ticks;
      root.appendChild(svg("text", { x: X(t), y: height - 6, "text-anchor": j === 0 ? "start" : (j === ticks ? "end" : "middle"), text: fmtClock(t) }));
    }
    [["lower", b.lower], ["upper", b.upper]].forEach(function (pair) {
      if (pair[1] !== null && pair[1] <= ymax) {
        root.appendChild(svg("line", { class: "bound", x1: left, x2: width - right, y1: Y(pair[1]), y2: Y(pair[1]) },
          svg("title", { text: "predicted " + pair[0] + " bound " + fmtSeconds(pair[1]) })));
      }
    });
    // Idle periods between bursts are not interpolated: a gap much longer than the usual spacing breaks the line.
    var gaps = [];
    for (var g = 1; g < hist.length; g++) gaps.push(num(hist[g].t) - num(hist[g - 1].t));
    var sortedGaps = gaps.slice().sort(function (a, b) { return a - b; });
    var breakGap = Math.max(3, 5 * (sortedGaps.length ? sortedGaps[Math.floor(sortedGaps.length / 2)] : 0));
    [["wait_s", "line-wait"], ["service_s", "line-service"], ["response_s", "line-response"]].forEach(function (series) {
      var d = [], prevT = null;
      hist.forEach(function (p) {
        var y = num(p[series[0]]), t = num(p.t);
        if (y === null) { prevT = null; return; }
        d.push((prevT === null || t - prevT > breakGap ? "M" : "L") + X(t).toFixed(1) + "," + Y(y).toFixed(1));
        prevT = t;
      });
      if (d.length) root.appendChild(svg("path", { class: series[1], d: d.join(" ") }));
    });
    if (hist.length <= 200) {
      hist.forEach(function (p) {
        var y = num(p.response_s);
        if (y === null) return;
        root.appendChild(svg("circle", { class: "dot-response", cx: X(num(p.t)), cy: Y(y), r: 2.5 },
          svg("title", { text: fmtClock(num(p.t)) + "  response " + fmtSeconds(y) + " = wait " + fmtSeconds(p.wait_s) + " + service " + fmtSeconds(p.service_s) })));
      });
    }
    container.replaceChildren(root);
  }

  function renderChains(data) {
    var container = $("chains");
    var chains = arr(data.chains).map(obj);
    var totalCap = 0, totalActive = 0, totalRate = 0;
    var cards = chains.map(function (ch, idx) {
      var ids = arr(ch.servers), names = arr(ch.names), blocks = arr(ch.blocks), spans = arr(ch.spans);
      var cap = int(ch.capacity) || 0, active = int(ch.active) || 0, T = num(ch.service_time);
      totalCap += cap; totalActive += active;
      if (T !== null && T > 0) totalRate += cap / T;
      var broken = false;
      var hops = [];
      ids.forEach(function (pid, i) {
        var id = str(pid);
        var srv = state.present.get(id);
        var gone = !srv || !isLive(srv);
        if (gone) broken = true;
        var name = str(names[i]).trim() || (srv ? serverName(srv) : shortId(id));
        var span = arr(spans[i]);
        var s0 = int(span[0]), s1 = int(span[1]);
        var m = int(blocks[i]);
        var label = (s0 !== null && s1 !== null ? "blocks " + s0 + "\u2013" + (s1 - 1) : "blocks ?") + (m !== null ? " (" + m + ")" : "");
        if (i > 0) hops.push(el("span", { class: "arrow", "aria-hidden": "true", text: "\u2192" }));
        var L = numBlocks(data);
        var bar = null;
        if (L && s0 !== null && s1 !== null) {
          bar = el("div", { class: "hop-bar" }, el("span", { style: {
            left: (100 * clamp(s0 / L, 0, 1)).toFixed(2) + "%", width: (100 * clamp((s1 - s0) / L, 0, 1)).toFixed(2) + "%" } }));
        }
        hops.push(el("div", { class: "hop" + (gone ? " gone" : ""), "data-peer-id": id, title: id },
          el("div", { class: "hop-name", text: name }),
          el("div", { class: "hop-blocks", text: label + (gone ? " \u00b7 gone" : "") }),
          bar));
      });
      var frac = cap > 0 ? clamp(active / cap, 0, 1) : 0;
      var cid = int(ch.id);
      return el("div", { class: "chain" + (broken ? " broken" : ""), "data-chain-id": cid === null ? idx : cid },
        el("div", { class: "chain-head" },
          el("span", { class: "chain-title", text: "chain " + (cid === null ? idx : cid) }),
          el("span", { class: "muted", text: ids.length + (ids.length === 1 ? " hop" : " hops") }),
          el("span", {}, "service time ", el("strong", { text: fmtSeconds(T) })),
          el("span", {}, "capacity ", el("strong", { class: "chain-capacity", text: String(cap) })),
          T !== null && T > 0 ? el("span", { class: "muted", text: "\u03bc = " + (1 / T).toFixed(2) + " jobs/s" }) : null,
          broken ? el("span", { class: "badge badge-bad", text: "server gone" }) : null),
        el("div", { class: "route" }, hops),
        el("div", { class: "occupancy" },
          el("span", { class: "muted", text: "running" }),
          el("div", { class: "bar" + (frac >= 1 ? " full" : ""), role: "meter", "aria-valuemin": 0, "aria-valuemax": cap, "aria-valuenow": active },
            el("span", { style: { width: (100 * frac).toFixed(1) + "%" } })),
          el("span", { class: "chain-active", text: active + " / " + cap })));
    });
    $("chains-summary").textContent = chains.length
      ? chains.length + " chains \u00b7 " + totalActive + " / " + totalCap + " jobs running \u00b7 max throughput " + totalRate.toFixed(2) + " jobs/s"
      : "";
    if (!cards.length) cards = [el("div", { class: "empty", text: data.ready === true ? "No chains." : "No chains yet: the orchestrator has not composed any (swarm not ready)." })];
    container.replaceChildren.apply(container, cards);
  }

  function numBlocks(data) {
    var L = int(data.num_blocks);
    if (L !== null && L > 0) return Math.min(L, 4096);
    var end = 0;
    arr(data.servers).map(obj).forEach(function (s) {
      var a = int(s.start_block), m = int(s.num_blocks);
      if (a !== null && m !== null) end = Math.max(end, a + m);
    });
    arr(data.chains).map(obj).forEach(function (c) {
      arr(c.spans).forEach(function (sp) { var e = int(arr(sp)[1]); if (e !== null) end = Math.max(end, e); });
    });
    return Math.min(end, 4096);
  }

  function renderCoverage(data, servers) {
    var container = $("coverage");
    var L = numBlocks(data);
    var rows = servers.filter(function (s) { return int(s.num_blocks) > 0 && int(s.start_block) !== null; });
    rows.sort(function (a, b) { return (int(a.start_block) - int(b.start_block)) || (int(b.num_blocks) - int(a.num_blocks)); });
    if (!L || !rows.length) {
      $("coverage-summary").textContent = "";
      container.replaceChildren(el("div", { class: "empty", text: "No server hosts blocks yet." }));
      return;
    }
    var counts = new Array(L).fill(0);
    rows.forEach(function (s) {
      if (!isLive(s)) return;
      var a = int(s.start_block), m = int(s.num_blocks);
      for (var b = Math.max(0, a); b < Math.min(L, a + m); b++) counts[b]++;
    });
    var avail = Math.max(300, (container.clientWidth || 800) - 4);
    var labelW = avail < 500 ? 86 : 130;
    var cell = Math.max(7, Math.min(64, Math.floor((avail - labelW) / L)));
    var rowH = 16, gap = 3, headH = 16;
    var width = labelW + cell * L + 2;
    var height = headH + (rows.length + 1) * (rowH + gap) + 4;
    var root = svg("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img",
      "aria-label": "which servers host which blocks, and how many servers cover each block" });
    var step = L <= 20 ? 1 : (L <= 50 ? 5 : 10);
    if (cell * step < 18) step = Math.ceil(18 / cell / 5) * 5;
    for (var b = 0; b < L; b += step) {
      root.appendChild(svg("text", { x: labelW + b * cell + cell / 2, y: 11, "text-anchor": "middle", text: String(b) }));
    }
    rows.forEach(function (s, r) {
      var y = headH + r * (rowH + gap);
      var name = serverName(s);
      var maxChars = Math.floor(labelW / 7);
      var label = name.length > maxChars ? name.slice(0, maxChars - 1) + "\u2026" : name;
      root.appendChild(svg("text", { x: 0, y: y + 12, text: label }, svg("title", { text: name + " (" + str(s.peer_id) + ")" })));
      root.appendChild(svg("rect", { class: "cov-empty", x: labelW, y: y, width: cell * L, height: rowH, rx: 2 }));
      var a = clamp(int(s.start_block), 0, L), e = clamp(int(s.start_block) + int(s.num_blocks), 0, L);
      if (e > a) {
        root.appendChild(svg("rect", { class: "cov-cell" + (isLive(s) ? "" : " gone"), x: labelW + a * cell, y: y,
          width: (e - a) * cell - 1, height: rowH, rx: 2, "data-peer-id": str(s.peer_id) },
          svg("title", { text: name + ": blocks " + a + "\u2013" + (e - 1) + (isLive(s) ? "" : " (offline)") })));
      }
    });
    var yc = headH + rows.length * (rowH + gap);
    root.appendChild(svg("text", { x: 0, y: yc + 12, text: "coverage" }));
    var holes = 0, minCov = Infinity;
    counts.forEach(function (n, b) {
      if (n === 0) holes++;
      minCov = Math.min(minCov, n);
      var cls = n === 0 ? "cov-count-0" : (n === 1 ? "cov-count-1" : "cov-count-n");
      root.appendChild(svg("rect", { class: cls, x: labelW + b * cell, y: yc, width: cell - 1, height: rowH, "data-block": b, "data-count": n },
        svg("title", { text: "block " + b + ": " + n + (n === 1 ? " server" : " servers") })));
      if (cell >= 10) root.appendChild(svg("text", { class: "cov-count-text", x: labelW + b * cell + (cell - 1) / 2, y: yc + 12, "text-anchor": "middle", text: String(n) }));
    });
    $("coverage-summary").textContent = L + " blocks \u00b7 " + (holes ? holes + " uncovered" : "all covered, min " + minCov + "\u00d7");
    container.replaceChildren(root);
  }

  function stateBadge(s, gone) {
    if (gone) return el("span", { class: "badge badge-gone", text: "gone" });
    var st = str(s.state) || "unknown";
    var cls = st === "online" ? "badge-ok" : (st === "joining" || st === "draining" ? "badge-warn" : (st === "offline" ? "badge-gone" : "badge-bad"));
    return el("span", { class: "badge " + cls, text: st });
  }

  // seenNowS: "now" on the clock of the servers' last_seen (the view's updated_at); goneSince and nowS: this browser's
  function serverRow(s, nowS, goneSince, seenNowS) {
    var gone = goneSince !== null || !isLive(s);
    var a = int(s.start_block), m = int(s.num_blocks);
    var span = a !== null && m !== null && m > 0 ? a + "\u2013" + (a + m - 1) + " (" + m + ")" : "none";
    // a paged KV cache is shown in tokens (sessions hold what their length needs), slots in slots
    var paged = str(s.kv_cache) === "paged" && int(s.cache_tokens_total);
    var total = paged ? int(s.cache_tokens_total) : int(s.slots_total);
    var free = paged ? int(s.cache_tokens_free) : int(s.slots_free);
    var used = total !== null && free !== null ? Math.max(0, total - free) : null;
    var frac = total ? clamp(used / total, 0, 1) : 0;
    var cacheText = paged ? fmtTokens(used) + " / " + fmtTokens(total) + " tok"
      : (used === null ? "?" : used) + " / " + (total === null ? "?" : total);
    var cacheTitle = paged ? "KV cache tokens used / total over the hosted blocks (pages of " + int(s.page_size) + " tokens)"
      : "KV cache slots of max_length tokens used / total";
    var prefix = null;
    if (s.prefix_cache === true) {
      var offered = int(s.prefix_offered_tokens), reused = int(s.prefix_reused_tokens);
      prefix = el("div", { class: "muted prefix-hits", title: "prefix cache: prompt tokens reused from cached pages / named at open",
        text: "prefix hits " + (offered ? (100 * reused / offered).toFixed(0) + "%" : "\u2014") });
    }
    var flags = [];
    var rtt = num(s.emulate_rtt_ms), scale = num(s.emulate_compute_scale);
    if (rtt !== null && rtt > 0) flags.push(el("span", { class: "flag", title: "emulated WAN round-trip time", text: "RTT " + rtt + " ms" }));
    if (scale !== null && scale !== 1) flags.push(el("span", { class: "flag", title: "emulated compute slowdown", text: "compute \u00d7" + scale }));
    var fault = str(s.emulate_reply_fault), faultRate = num(s.emulate_reply_fault_rate);
    if (fault && fault !== "none" && faultRate) flags.push(el("span", { class: "flag", title: "test mode: corrupts this fraction of its replies", text: "faulty " + fault + " " + (100 * faultRate).toFixed(0) + "%" }));
    // verified chains: what audits against other servers found
    var trust = obj(s.trust), trustLine = null;
    if (trust.banned === true) trustLine = el("div", { class: "trust banned", title: "audits found it returning wrong hidden states: never planned again", text: "banned: wrong results" });
    else if (int(trust.audits)) trustLine = el("div", { class: "muted trust", title: "audited steps it took part in / strikes (decaying)", text: "audits " + int(trust.audits) + " \u00b7 strikes " + (int(trust.strikes) || 0) });
    // how the orchestrator reaches it: directly at its own address, through the relay (NAT), or not at all
    var reach = str(s.reachability), reachLine = null;
    if (reach && reach !== "unknown") {
      var addrs = Array.isArray(s.maddrs) ? s.maddrs.map(str).join("\n") : "";
      var reachTitle = reach === "relayed" ? "behind NAT: reached through the orchestrator's circuit relay\n" + addrs
        : reach === "unreachable" ? "the orchestrator cannot dial its announced addresses: not planned\n" + str(s.reachability_error)
        : reach === "pending" ? "checking that its announced addresses can be dialed" : "dialed directly at\n" + addrs;
      reachLine = el("div", { class: "reach reach-" + reach, title: reachTitle, text: reach });
    }
    // its record says it cannot load the blocks it was assigned (too little cache, out of memory, ...): planned around
    var loadError = str(s.load_error), loadLine = null;
    if (loadError) {
      var fs = Array.isArray(s.failed_span) && s.failed_span.length === 2 ? s.failed_span.map(int) : null;
      var where = fs && fs[0] !== null && fs[1] ? " " + fs[0] + "\u2013" + (fs[0] + fs[1] - 1) : "";
      // the orchestrator's --load-deadline-s speaks for a server that said nothing (its load hangs, an older one)
      var overdue = loadError.indexOf("not online ") === 0;
      loadLine = el("div", { class: "load-error", text: overdue ? "not online with its blocks" : "cannot load its blocks",
        title: "cannot load its assigned blocks" + where + ": " + loadError + "\nplanned around until it loads them or restarts" });
    }
    // a server offering several models serves one of them at a time
    var offers = Array.isArray(s.models) ? s.models.map(str) : [], offersLine = null;
    if (offers.length > 1) {
      offersLine = el("div", { class: "muted offers", title: "offers " + offers.join(", ") + "; serves " + str(s.serving),
        text: "offers " + offers.length + " models" });
    }
    // the hop's time per decode step as relayed steps showed it: compute over its blocks + the rest of the round trip
    var stepCompute = num(s.step_compute_s), stepNetwork = num(s.step_network_s), stepLine = null;
    if (stepCompute !== null) {
      stepLine = el("div", { class: "muted step-times", title: "observed per decode step (moving average): the server's compute over its blocks + the rest of the hop's round trip",
        text: "step " + fmtSeconds(stepCompute) + (stepNetwork !== null ? " + " + fmtSeconds(stepNetwork) + " net" : "") });
    }
    var lastSeen = goneSince !== null ? "left " + fmtAgo(goneSince, nowS) : fmtAgo(s.last_seen, seenNowS);
    var hw = [str(s.device), str(s.dtype)].filter(Boolean).join(" \u00b7 ");
    return el("tr", { "data-peer-id": str(s.peer_id), "data-state": gone ? "gone" : str(s.state), class: gone ? "gone" : null },
      el("td", { "data-label": "name" },
        el("div", {}, el("div", { class: "server-name", text: serverName(s) }), el("div", { class: "peer-id", title: str(s.peer_id), text: shortId(s.peer_id) }),
          versionLine(s, state.version))),
      el("td", { "data-label": "state" }, stateBadge(s, goneSince !== null), trustLine, reachLine, loadLine, offersLine),
      el("td", { "data-label": "blocks", class: "num" }, el("span", { text: span })),
      el("td", { "data-label": "memory", class: "num" }, el("span", { title: hw, text: fmtBytes(s.memory_bytes) + (hw ? " \u00b7 " + hw : "") })),
      el("td", { "data-label": "KV cache" },
        el("div", { class: "slots", title: cacheTitle },
          el("div", { class: "bar slots" + (frac >= 1 ? " full" : "") }, el("span", { style: { width: (100 * frac).toFixed(1) + "%" } })),
          el("span", { class: "num", text: cacheText })), prefix),
      el("td", { "data-label": "\u03c4p /block", class: "num" }, el("span", { text: fmtSeconds(s.tau_p) }), stepLine),
      el("td", { "data-label": "\u03c4c", class: "num" }, el("span", { text: fmtSeconds(s.tau_c) })),
      el("td", { "data-label": "emulation" }, el("span", {}, flags.length ? flags : "off")),
      el("td", { "data-label": "last seen", class: "num" }, el("span", { text: lastSeen })));
  }

  function renderServers(data, servers, nowMs) {
    var nowS = nowMs / 1000;
    // last_seen is on the clock of whoever wrote the view (the orchestrator, the standalone dashboard): measured from
    // its updated_at (plus the age of a stale view), not from this browser's clock, which may be minutes off
    var updated = num(data.updated_at), staleS = num(data.stale_s);
    var seenNowS = updated !== null && updated > 0 ? updated + (staleS !== null ? staleS : 0) : nowS;
    var sorted = servers.slice().sort(function (a, b) {
      return ((int(a.start_block) || 0) - (int(b.start_block) || 0)) || serverName(a).localeCompare(serverName(b));
    });
    var rows = sorted.map(function (s) { return serverRow(s, nowS, null, seenNowS); });
    state.gone.forEach(function (g) { rows.push(serverRow(g.server, nowS, g.since / 1000, seenNowS)); });
    var online = servers.filter(function (s) { return s.state === "online"; }).length;
    var notListed = goneNotListed(), floor = nowMs < state.goneForgottenUntil ? "+" : ""; // some forgotten
    var goneCount = state.gone.size + state.goneDropped.size +
      servers.filter(function (s) { return !isLive(s); }).length;
    $("servers-summary").textContent = servers.length + " known \u00b7 " + online + " online" + (goneCount ? " \u00b7 " + goneCount + " gone" : "") +
      (notListed ? " (" + notListed + floor + " that left earlier not listed)" : "");
    if (!rows.length) rows = [el("tr", {}, el("td", { colspan: 9, class: "muted", text: "No servers have announced themselves yet." }))];
    var tbody = $("servers-table").tBodies[0];
    tbody.replaceChildren.apply(tbody, rows);
  }

  // Fair sharing among clients (seed 002): service per client, waits, Jain's index among backlogged clients;
  // deadlines (seed 003): outcomes and goodput per client.
  function deadlineCell(d) {
    var decided = ["met", "missed", "refused", "dropped"].reduce(function (a, k) { return a + (int(d[k]) || 0); }, 0);
    if (!decided) return "\u2014";
    var met = int(d.met) || 0;
    return met + "/" + decided + " (" + Math.round(100 * met / decided) + "%)";
  }

  function renderClients(data) {
    var fair = obj(data.fairness);
    var clients = obj(fair.clients);
    var dls = obj(data.deadlines);
    var dlClients = obj(dls.clients);
    var seen = {};
    var names = Object.keys(clients).concat(Object.keys(dlClients)).filter(function (n) {
      if (seen[n]) return false;
      seen[n] = true;
      return true;
    }).sort();
    var jain = num(fair.jain_index);
    var parts = [];
    if (fair.policy) parts.push("policy " + str(fair.policy));
    var quantum = num(fair.quantum);
    if (quantum !== null && fair.policy !== "fcfs") parts.push("Q\u1d58 " + Math.round(quantum) + (fair.quantum_mode === "auto" ? " (auto)" : ""));
    parts.push("Jain " + (jain === null ? "\u2014" : jain.toFixed(3)));
    if (dls.schedule) parts.push("schedule " + str(dls.schedule));
    if (int(dls.paused)) parts.push(int(dls.paused) + " paused for deadlines");
    var goodput = num(dls.goodput_per_s);
    if (goodput !== null && deadlineCell(dls) !== "\u2014") parts.push("goodput " + goodput.toFixed(2) + " /s");
    $("clients-summary").textContent = parts.join(" \u00b7 ");
    var rows = names.map(function (name) {
      var c = obj(clients[name]);
      var d = obj(dlClients[name]);
      var rate = num(c.service_rate);
      var gp = num(d.goodput_per_s);
      return el("tr", { "data-client": name, class: c.backlogged ? "backlogged" : "" },
        el("td", { "data-label": "client" }, el("span", { text: name })),
        el("td", { "data-label": "requests", class: "num" }, el("span", { text: String(int(c.requests) || 0) })),
        el("td", { "data-label": "waiting", class: "num" }, el("span", { text: String(int(c.waiting) || 0) })),
        el("td", { "data-label": "service", class: "num" }, el("span", { text: fmtTokens(num(c.service) || 0) })),
        el("td", { "data-label": "service rate", class: "num" }, el("span", { text: rate === null ? "\u2014" : rate.toFixed(1) + " /s" })),
        el("td", { "data-label": "mean wait", class: "num" }, el("span", { text: fmtSeconds(num(c.wait_mean_s)) })),
        el("td", { "data-label": "max wait", class: "num" }, el("span", { text: fmtSeconds(num(c.wait_max_s)) })),
        el("td", { "data-label": "deadlines met", class: "num" }, el("span", { text: deadlineCell(d) })),
        el("td", { "data-label": "goodput", class: "num" }, el("span", { text: gp === null || deadlineCell(d) === "\u2014" ? "\u2014" : gp.toFixed(2) + " /s" })));
    });
    if (!rows.length) rows = [el("tr", {}, el("td", { colspan: 9, class: "muted", text: "No client has sent a request yet." }))];
    var tbody = $("clients-table").tBodies[0];
    tbody.replaceChildren.apply(tbody, rows);
  }

  // --schedule db|mlfq (seed 001): each service's learnt execution time; services model:k are length classes.
  function renderSchedule(data) {
    var sc = data.schedule && typeof data.schedule === "object" ? data.schedule : null;
    var services = sc && sc.services && typeof sc.services === "object" ? sc.services : null;
    $("schedule-panel").hidden = services === null;
    if (services === null) return;
    var classes = obj(sc.classes);
    var centroids = arr(classes.centroids_tokens);
    var parts = [str(sc.name)];
    if (int(classes.k)) parts.push(int(classes.k) + " length classes" + (centroids.length ? "" : " (learning)"));
    parts.push((int(sc.priority_preemptions) || 0) + " pauses for priority");
    parts.push((int(sc.starvation_promotions) || 0) + " starved jobs put first");
    $("schedule-summary").textContent = parts.join(" \u00b7 ");
    var rows = Object.keys(services).sort().map(function (name) {
      var s = obj(services[name]);
      var m = /:(\d+)$/.exec(name);
      var c = m ? arr(centroids[int(m[1])]) : [];
      var cls = c.length === 2 ? int(c[0]) + " \u2192 " + int(c[1]) + " tokens" : "\u2014";
      return el("tr", { "data-service": name },
        el("td", { "data-label": "service" }, el("span", { text: name })),
        el("td", { "data-label": "length class" }, el("span", { text: cls })),
        el("td", { "data-label": "mean execution", class: "num" }, el("span", { text: fmtSeconds(num(s.mean_exec_s)) })),
        el("td", { "data-label": "std", class: "num" }, el("span", { text: fmtSeconds(num(s.std_exec_s)) })),
        el("td", { "data-label": "completed", class: "num" }, el("span", { text: String(int(s.completed) || 0) })));
    });
    if (!rows.length) rows = [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "No job has finished yet." }))];
    var tbody = $("schedule-table").tBodies[0];
    tbody.replaceChildren.apply(tbody, rows);
  }

  // Several orchestrators on one swarm (HERD groups): who leads, each one's group size, arrival rate and URL.
  function renderGroups(data) {
    var groups = data.groups && typeof data.groups === "object" ? data.groups : null;
    $("orchestrators-panel").hidden = groups === null;
    if (groups === null) return;
    var orchs = arr(groups.orchestrators).filter(function (o) { return o && typeof o === "object"; });
    var parts = [orchs.length + " orchestrators", "split epoch " + (int(groups.epoch) || 0)];
    if (groups.split_method) parts.push(str(groups.split_method));
    if (int(groups.forwarded)) parts.push(int(groups.forwarded) + " requests forwarded");
    $("orchestrators-summary").textContent = parts.join(" \u00b7 ");
    var rows = orchs.map(function (o) {
      var role = [];
      if (o.peer_id === groups.leader) role.push("leader");
      if (o.peer_id === groups.me) role.push("this one");
      var rate = num(o.arrival_rate);
      var url = /^https?:\/\//.test(str(o.http_url)) ? str(o.http_url) : "";  // a link only to an http(s) URL
      return el("tr", { "data-orchestrator": str(o.peer_id) },
        el("td", { "data-label": "peer id" }, el("span", { title: str(o.peer_id), text: shortId(str(o.peer_id)) })),
        el("td", { "data-label": "role" }, el("span", { text: role.join(", ") || "\u2014" })),
        el("td", { "data-label": "API" }, url ? el("a", { href: url, text: url }) : el("span", { class: "muted", text: "\u2014" })),
        el("td", { "data-label": "servers", class: "num" }, el("span", { text: String(int(o.servers) || 0) })),
        el("td", { "data-label": "arrival rate", class: "num" }, el("span", { text: rate === null ? "\u2014" : rate.toFixed(2) + " /s" })),
        el("td", { "data-label": "state" }, el("span", { class: o.live ? "" : "muted", text: o.live ? "live" : "silent" })));
    });
    var tbody = $("orchestrators-table").tBodies[0];
    tbody.replaceChildren.apply(tbody, rows);
  }

  // Redraw the size-dependent SVGs on resize (phone rotation) without refetching.
  var resizeTimer = null;
  window.addEventListener("resize", function () {
    if (resizeTimer) clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      if (!state.last) return;
      renderBounds(state.last);
      renderLatencyChart(state.last);
      renderCoverage(state.last, arr(state.last.servers).filter(function (s) { return s && typeof s === "object" && s.peer_id !== undefined; }));
    }, 150);
  });

  $("refresh-select").addEventListener("change", function (ev) { setPeriod(num(ev.target.value) || 0, true); });
  setPeriod(readInitialPeriod(), false);
})();
