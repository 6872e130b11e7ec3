// qkv attention viewer. Inlined once per viewer inside a closure: it defines nothing global,
// reads its data from the <script class="qkv-data"> in its own root element, and never fetches.
function qkvViewer(root) {
  "use strict";
  const t0 = performance.now();
  const data = JSON.parse(root.querySelector("script.qkv-data").textContent);
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173",
    "#3182bd"];
  const ROW = 18, COLW = 150, LINEW = 260;
  // Viridis, five stops, interpolated into a 256-entry lookup table.
  const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const RAMP = new Uint8Array(256 * 3);
  for (let v = 0; v < 256; v++) {
    const x = v / 255 * 4, i = Math.min(3, Math.floor(x)), f = x - i;
    for (let c = 0; c < 3; c++) RAMP[v * 3 + c] = Math.round(STOPS[i][c] * (1 - f) + STOPS[i + 1][c] * f);
  }

  // Weights travel as round(255·sqrt(w)) (viewer_data.py): small weights keep a code.
  const WEIGHT = new Float64Array(256).map((_, v) => (v / 255) * (v / 255));

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function bytes(b64) {
    const s = atob(b64), out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  function decoded(layer) { // typed arrays, decoded on first use and kept
    if (!layer._idx) {
      const raw = bytes(layer.idx);
      layer._idx = layer.idxBytes === 2 ? new Uint16Array(raw.buffer) : new Uint32Array(raw.buffer);
      layer._w = bytes(layer.w);
    }
    return layer;
  }
  function colour(h) { return PALETTE[h % PALETTE.length]; }
  // Each side's axis: token labels, or time ("kind": "time", "seconds" per position).
  function axis(side) { return (data.axes && data.axes[side]) || { kind: "tokens" }; }
  function axisText(side, n) {
    const a = axis(side);
    return a.kind === "time" ? `time axis, ${a.seconds} ${a.unit || "s"} per position, ` +
      `${(n * a.seconds).toFixed(2)} ${a.unit || "s"} in all` : "tokens";
  }
  function select(options, onchange) {
    const s = el("select");
    options.forEach((text, i) => { const o = el("option", "", text); o.value = i; s.appendChild(o); });
    s.addEventListener("change", () => onchange(+s.value));
    return s;
  }
  // The colour scale's top: the head's maximum, or (sink discounted) its maximum outside the
  // first key column, above which cells saturate.
  function scaleTop(pic, head, sink) {
    return sink && pic.maxRest && pic.maxRest[head] > 0 ? pic.maxRest[head] : pic.max[head];
  }
  function paint(canvas, pic, head, sink) { // one head of a block-mean picture into a canvas
    canvas.width = pic.c; canvas.height = pic.r;
    if (!pic._u8) pic._u8 = bytes(pic.data);
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(pic.c, pic.r);
    const off = head * pic.r * pic.c, gain = pic.max[head] / scaleTop(pic, head, sink);
    for (let p = 0; p < pic.r * pic.c; p++) {
      const v = Math.min(255, Math.round(pic._u8[off + p] * gain));
      img.data[p * 4] = RAMP[v * 3]; img.data[p * 4 + 1] = RAMP[v * 3 + 1];
      img.data[p * 4 + 2] = RAMP[v * 3 + 2]; img.data[p * 4 + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  // Head view: queries left, keys right, lines to the top-k keys; only visible rows are drawn.
  function HeadView(panel, groups) {
    // Opens on one head (the group's most focused: see viewer_data.focus), not a tangle of all.
    const open = groups[0].open;
    const st = { g: 0, layer: open ? open.layer : 0, heads: open ? new Set([open.head]) : null,
      focus: null, frame: 0 };
    const controls = el("div", "qkv-controls"), axesRow = el("div", "qkv-axes");
    panel.append(controls, axesRow);
    const scroll = el("div", "qkv-scroll"), stage = el("div", "qkv-stage");
    const left = el("div", "qkv-col qkv-left"), right = el("div", "qkv-col qkv-right");
    const canvas = el("canvas", "qkv-lines");
    stage.append(left, canvas, right);
    scroll.appendChild(stage);
    panel.appendChild(scroll);
    const note = el("div", "qkv-note");
    panel.appendChild(note);
    left.style.left = "0px"; left.style.width = COLW + "px";
    canvas.style.left = COLW + "px";
    right.style.left = (COLW + LINEW) + "px"; right.style.width = COLW + "px";
    stage.style.width = (2 * COLW + LINEW) + "px";
    const pools = { left: [], right: [] };

    function group() { return groups[st.g]; }
    function layer() { return decoded(group().layers[st.layer]); }
    function buildControls() {
      controls.textContent = "";
      if (groups.length > 1) {
        controls.append(el("span", "", "Attention:"), select(groups.map(g => g.title), g => {
          const o = groups[g].open;
          st.g = g; st.layer = o ? o.layer : 0; st.heads = o ? new Set([o.head]) : null;
          st.focus = null; buildControls(); layout(); draw();
        }));
        controls.lastChild.value = st.g;
      }
      const L = group().layers;
      controls.append(el("span", "", "Layer:"), select(L.map(l => l.name), l => {
        st.layer = l; st.focus = null; buildControls(); draw();
      }));
      controls.lastChild.value = st.layer;
      controls.lastChild.className = "qkv-layer";
      const heads = L[st.layer].heads;
      if (!st.heads) st.heads = new Set(heads);
      controls.appendChild(el("span", "", "Heads:"));
      const all = el("button", "", "all"), none = el("button", "", "one");
      all.title = "show every head"; none.title = "show only the most focused head";
      all.addEventListener("click", () => { st.heads = new Set(heads); buildControls(); draw(); });
      none.addEventListener("click", () => {
        const f = L[st.layer].focus, best = f ? heads[f.indexOf(Math.max(...f))] : heads[0];
        st.heads = new Set([best]); buildControls(); draw();
      });
      controls.append(all, none);
      heads.forEach(h => {
        const chip = el("span", "qkv-chip" + (st.heads.has(h) ? "" : " qkv-off"));
        const sw = el("i"); sw.style.background = colour(h);
        chip.append(sw, document.createTextNode(String(h)));
        chip.dataset.head = h;
        chip.title = "click: show/hide; double-click: only this head";
        chip.addEventListener("click", () => {
          if (st.heads.has(h)) st.heads.delete(h); else st.heads.add(h);
          chip.classList.toggle("qkv-off", !st.heads.has(h)); draw();
        });
        chip.addEventListener("dblclick", () => { st.heads = new Set([h]); buildControls(); draw(); });
        controls.appendChild(chip);
      });
    }
    function layout() {
      const g = group(), l = g.layers[0];
      const n = Math.max(l.T, l.S);
      stage.style.height = n * ROW + "px";
      scroll.style.height = Math.min(600, n * ROW + 2) + "px";
      scroll.scrollTop = 0;
      axesRow.textContent = "";
      const hq = el("span", "qkv-axis-q", "queries (" + axisText(g.q, l.T) + ")");
      const hk = el("span", "qkv-axis-k", "keys (" + axisText(g.k, l.S) + ")");
      hq.style.width = COLW + "px"; hk.style.marginLeft = LINEW + "px";
      axesRow.append(hq, hk);
      panel.dataset.keyAxis = axis(g.k).kind;
      const o = g.open;
      note.textContent = (o ? `Opened on layer ${g.layers[o.layer].name}, head ${o.head}: the most ` +
        `focused head (mean top key share ${o.focus.toFixed(2)}, first key set aside); click ` +
        "heads to add them, \"all\" for every head. " : "") +
        `${l.T} queries × ${l.S} keys; lines to each query's ${l.k} most-attended ` +
        "keys, opacity = weight relative to its strongest key. Hover a token to focus it (a key's " +
        "tooltip then shows its weight); scroll for more.";
    }
    function tokens(side) { return data.tokens[side]; }
    function place(pool, col, a, b, labels, side) { // reuse a pool of divs for rows a..b-1
      while (pool.length < b - a) { const d = el("div", "qkv-tok"); col.appendChild(d); pool.push(d); }
      pool.forEach((d, k) => {
        const i = a + k;
        if (i >= b) { d.style.display = "none"; return; }
        d.style.display = ""; d.style.top = i * ROW + "px"; d.style.width = COLW + "px";
        d.textContent = labels[i]; d.dataset.index = i; d.dataset.side = side;
        d.title = `${side === "q" ? "query" : "key"} ${i}: ${labels[i]}`;
        const f = st.focus;
        d.classList.toggle("qkv-focus", !!f && f.side === side && f.index === i);
        d.style.background = "";
        d.classList.toggle("qkv-time", axis(side === "q" ? group().q : group().k).kind === "time");
      });
    }
    function draw() {
      const g = group(), l = layer(), top = scroll.scrollTop, H = scroll.clientHeight || 600;
      const a = Math.max(0, Math.floor(top / ROW) - 1), dpr = window.devicePixelRatio || 1;
      const bq = Math.min(l.T, Math.ceil((top + H) / ROW) + 1), bk = Math.min(l.S, Math.ceil((top + H) / ROW) + 1);
      place(pools.left, left, Math.min(a, l.T), bq, tokens(g.q), "q");
      place(pools.right, right, Math.min(a, l.S), bk, tokens(g.k), "k");
      canvas.style.top = top + "px"; canvas.style.width = LINEW + "px"; canvas.style.height = H + "px";
      canvas.width = LINEW * dpr; canvas.height = H * dpr;
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, LINEW, H);
      ctx.lineWidth = 1.5;
      const f = st.focus, K = l.k, T = l.T;
      let drawn = 0;
      const hit = new Map(); // key index -> [strongest relative weight, text], for highlights
      l.heads.forEach((h, hi) => {
        if (!st.heads.has(h)) return;
        ctx.strokeStyle = colour(h);
        // Opacity: the weight relative to the query's strongest key (top-k entry 0), so long
        // inputs, whose weights are all small, still show where each query looks.
        const line = (i, r, j) => {
          const p = (hi * T + i) * K + r, rel = WEIGHT[l._w[p]] / WEIGHT[l._w[p - r]];
          ctx.globalAlpha = f ? 0.15 + 0.85 * rel : 0.8 * rel;
          ctx.beginPath();
          ctx.moveTo(0, i * ROW + ROW / 2 - top); ctx.lineTo(LINEW, j * ROW + ROW / 2 - top);
          ctx.stroke(); drawn++;
          if (f && f.side === "q" && rel > (hit.get(j) || [0])[0]) {
            hit.set(j, [rel, `head ${h}: weight ${WEIGHT[l._w[p]].toPrecision(3)}`]);
          }
        };
        if (f && f.side === "k") { // every query (on screen or not) whose top-k holds this key
          for (let i = 0; i < T; i++) for (let r = 0; r < K; r++) {
            const p = (hi * T + i) * K + r;
            if (l._idx[p] === f.index && l._w[p] > 0) line(i, r, f.index);
          }
          return;
        }
        const from = f ? f.index : a, to = f ? f.index + 1 : bq;
        for (let i = from; i < to; i++) for (let r = 0; r < K; r++) {
          const p = (hi * T + i) * K + r;
          if (l._w[p] > 0) line(i, r, l._idx[p]);
        }
      });
      ctx.globalAlpha = 1;
      pools.right.forEach(d => {
        const h = hit.get(+d.dataset.index);
        if (h) {
          d.style.background = `rgba(31, 78, 153, ${(0.6 * h[0]).toFixed(3)})`;
          d.title += ` (${h[1]})`;
        }
      });
      panel.dataset.layer = st.layer;
      panel.dataset.group = st.g;
      panel.dataset.focus = f ? f.side + f.index : "";
      panel.dataset.lines = drawn;
      panel.dataset.draws = (+(panel.dataset.draws || 0)) + 1;
    }
    function onHover(ev) {
      const d = ev.target.closest(".qkv-tok");
      if (!d || !stage.contains(d)) return;
      const f = { side: d.dataset.side, index: +d.dataset.index };
      if (st.focus && st.focus.side === f.side && st.focus.index === f.index) return;
      st.focus = f; draw();
    }
    stage.addEventListener("mouseover", onHover);
    stage.addEventListener("mouseleave", () => { if (st.focus) { st.focus = null; draw(); } });
    scroll.addEventListener("scroll", () => {
      if (st.frame) return;
      st.frame = requestAnimationFrame(() => { st.frame = 0; draw(); });
    });
    buildControls(); layout();
    return { draw };
  }

  // Under a picture whose keys are a time axis: five ticks, in seconds, across its width.
  function timeTicks(box, side, n) {
    box.textContent = "";
    const a = axis(side);
    if (a.kind !== "time") return;
    for (let t = 0; t <= 4; t++) {
      const tick = el("span", "qkv-tick", `${(t / 4 * n * a.seconds).toFixed(2)} ${a.unit || "s"}`);
      tick.style.left = `${t * 25}%`;
      box.appendChild(tick);
    }
  }

  // Model view: layers × heads thumbnails; a click opens one as a heatmap with token labels
  // on both axes and a colour scale. "Discount the sink" scales colours to each head's maximum
  // outside the first key (which often takes most of every row) and saturates that key.
  function ModelView(panel, groups) {
    const st = { g: 0, sink: false, open: null };
    const controls = el("div", "qkv-controls"), body = el("div", "qkv-model");
    panel.append(controls, body);
    function binLabels(labels, n, bins) { // the first label of each block-mean bin
      return Array.from({ length: bins }, (_, b) => {
        const i0 = Math.floor(b * n / bins), i1 = Math.floor((b + 1) * n / bins);
        return (labels[i0] ?? String(i0)) + (i1 - i0 > 1 ? ` …(${i1 - i0})` : "");
      });
    }
    function axisLabels(box, texts, vertical) { // at most ~24 labels, evenly thinned
      box.textContent = "";
      const step = Math.max(1, Math.ceil(texts.length / 24)), size = 360 / texts.length;
      for (let b = 0; b < texts.length; b += step) {
        const t = el("span", "qkv-hlab", texts[b]);
        t.title = texts[b];
        if (vertical) t.style.top = (b + 0.5) * size + "px"; else t.style.left = (b + 0.5) * size + "px";
        box.appendChild(t);
      }
    }
    function build() {
      controls.textContent = ""; body.textContent = "";
      if (groups.length > 1) {
        const s = select(groups.map(g => g.title), g => { st.g = g; st.open = null; build(); });
        s.value = st.g;
        controls.append(el("span", "", "Attention:"), s);
      }
      const sinkBox = el("input"); sinkBox.type = "checkbox"; sinkBox.checked = st.sink;
      sinkBox.className = "qkv-sink";
      const sinkLab = el("label", "", " discount the first key (attention sink)");
      sinkLab.prepend(sinkBox);
      sinkBox.addEventListener("change", () => { st.sink = sinkBox.checked; build(); });
      controls.append(sinkLab, el("span", "qkv-note", "Each head scaled to its own maximum; click one to open it."));
      const g = groups[st.g], L = g.layers, cols = Math.max(...L.map(l => l.heads.length));
      const grid = el("div", "qkv-grid");
      grid.style.gridTemplateColumns = `auto repeat(${cols}, 58px)`;
      const wrap = el("div"); wrap.style.maxHeight = "620px"; wrap.style.overflowY = "auto";
      wrap.appendChild(grid);
      grid.appendChild(el("span"));
      for (let c = 0; c < cols; c++) grid.appendChild(el("span", "qkv-lab", "head " + (L[0].heads[c] ?? c)));
      const detail = el("div", "qkv-detail"), cap = el("div", "qkv-note");
      const heat = el("div", "qkv-heat"), ylab = el("div", "qkv-ylabels"), big = el("canvas");
      const xlab = el("div", "qkv-xlabels"), bar = el("div", "qkv-cbar"), ticks = el("div", "qkv-ticks");
      heat.append(ylab, big, bar);
      detail.append(heat, xlab, ticks, cap);
      function openHead(li, c, cv) {
        const l = L[li];
        grid.querySelectorAll("canvas.qkv-picked").forEach(x => x.classList.remove("qkv-picked"));
        if (cv) cv.classList.add("qkv-picked");
        paint(big, l.detail, c, st.sink);
        const d = l.detail, top = scaleTop(d, c, st.sink);
        axisLabels(ylab, binLabels(data.tokens[g.q], l.T, d.r), true);
        if (axis(g.k).kind === "time") { xlab.textContent = ""; timeTicks(ticks, g.k, l.S); } else {
          ticks.textContent = ""; axisLabels(xlab, binLabels(data.tokens[g.k], l.S, d.c), false);
        }
        bar.textContent = "";
        const strip = el("canvas", "qkv-cbar-strip"); strip.width = 1; strip.height = 256;
        const sctx = strip.getContext("2d"), img = sctx.createImageData(1, 256);
        for (let v = 0; v < 256; v++) {
          const q = (255 - v) * 4;
          img.data[q] = RAMP[v * 3]; img.data[q + 1] = RAMP[v * 3 + 1]; img.data[q + 2] = RAMP[v * 3 + 2]; img.data[q + 3] = 255;
        }
        sctx.putImageData(img, 0, 0);
        bar.append(el("span", "qkv-cbar-top", top.toPrecision(3) + (st.sink ? "+" : "")), strip,
          el("span", "qkv-cbar-bottom", "0"));
        bar.title = "attention weight" + (st.sink ? " (first key saturates above the top)" : "");
        cap.textContent = `${l.name}, head ${l.heads[c]}: ${l.T} queries (down) × ${l.S} keys (across)` +
          (d.r < l.T || d.c < l.S ? `, block means ${d.r} × ${d.c}` : "") +
          `; colour: weight from 0 to ${top.toPrecision(3)}` +
          (st.sink ? ` (the maximum outside the first key; the first key's ${d.max[c].toPrecision(3)} saturates)` :
            " (the head's maximum)") +
          (axis(g.k).kind === "time" ? `; keys: ${axisText(g.k, l.S)}` : "");
        panel.dataset.open = `${li},${l.heads[c]}`;
        st.open = [li, c];
      }
      L.forEach((l, li) => {
        grid.appendChild(el("span", "qkv-lab", l.name));
        for (let c = 0; c < cols; c++) {
          if (c >= l.heads.length) { grid.appendChild(el("span")); continue; }
          const cv = el("canvas");
          paint(cv, l.thumb, c, st.sink);
          cv.title = `${l.name}, head ${l.heads[c]}`;
          cv.dataset.layer = li; cv.dataset.head = l.heads[c];
          cv.addEventListener("click", () => openHead(li, c, cv));
          grid.appendChild(cv);
        }
      });
      body.append(wrap, detail);
      // Open the head shown before, else the group's most focused head.
      const o = st.open || (g.open ? [g.open.layer, L[g.open.layer].heads.indexOf(g.open.head)] : [0, 0]);
      const pick = grid.querySelector(`canvas[data-layer="${o[0]}"][data-head="${L[o[0]].heads[o[1]]}"]`);
      openHead(o[0], Math.max(0, o[1]), pick);
    }
    build();
  }

  // The root keeps its <style> and <script> children; the interface goes in one child of its own.
  const ui = el("div", "qkv-ui");
  root.appendChild(ui);
  ui.appendChild(el("div", "qkv-title", data.title));
  const tabs = el("div", "qkv-tabs");
  ui.appendChild(tabs);
  const own = data.groups.filter(g => g.kind !== "cross"), cross = data.groups.filter(g => g.kind === "cross");
  const views = [];
  if (data.groups.length) {
    views.push(["Head view", "qkv-head", own.length ? own : cross, HeadView],
               ["Model view", "qkv-model-view", data.groups, ModelView]);
  }
  if (cross.length && own.length) views.push(["Cross-attention", "qkv-cross", cross, HeadView]);
  // The other views live in neuron.js and timeline.js (same closure); they get the helpers.
  const U = { el, select, bytes, colour, RAMP, WEIGHT };
  if (data.neuron && data.neuron.length) views.push(["Neuron view", "qkv-neuron", data, (p, d) => NeuronView(p, d, U)]);
  if (data.timeline) views.push(["Generation timeline", "qkv-timeline", data.timeline, (p, t) => TimelineView(p, t, U)]);
  const panels = views.map(([label, cls, groups, make]) => {
    const b = el("button", "", label), p = el("div", "qkv-panel " + cls);
    tabs.appendChild(b); ui.appendChild(p);
    let built = false;
    const show = () => {
      tabs.querySelectorAll("button").forEach(x => x.classList.remove("qkv-on"));
      ui.querySelectorAll(":scope > .qkv-panel").forEach(x => x.classList.remove("qkv-on"));
      b.classList.add("qkv-on"); p.classList.add("qkv-on");
      if (!built) { built = true; const v = make(p, groups); if (v && v.draw) v.draw(); }
    };
    b.addEventListener("click", show);
    return show;
  });
  // An encoder-decoder's page opens on its cross-attention (what connects output to input).
  const first = views.findIndex(v => v[1] === "qkv-cross");
  panels[first >= 0 ? first : 0]();
  root.dataset.ready = "1";
  root.dataset.renderMs = (performance.now() - t0).toFixed(1);
}
