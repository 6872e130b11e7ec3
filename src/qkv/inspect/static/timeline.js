// Generation timeline (inlined after viewer.js, inside the same closure): the text grows one
// token per decoding step; each visible token is shaded by the attention the step's query
// (the token that chose the next one) pays it. Data: timeline.py's Generation.page_data.
function TimelineView(panel, tl, U) {
  const st = { layer: 0, head: -1, step: tl.steps - 1, timer: 0 };
  const N = tl.steps, S = tl.S, P = tl.prompt;
  const controls = U.el("div", "qkv-controls"), info = U.el("div", "qkv-tl-info");
  const text = U.el("div", "qkv-tl-text"), note = U.el("div", "qkv-note");
  const heat = U.el("canvas", "qkv-tl-heat");
  panel.append(controls, info, text, heat, note);
  const codes = tl.layers.map(l => null);

  function layerCodes() { // (H', N, S) uint8, decoded on first use
    if (!codes[st.layer]) codes[st.layer] = U.bytes(tl.layers[st.layer].w);
    return codes[st.layer];
  }
  function row(s) { // the weights of step s over keys 0..P-1+s: one head, or the heads' mean
    const c = layerCodes(), heads = tl.layers[st.layer].heads, n = P + s, out = new Float64Array(n);
    const pick = st.head < 0 ? heads.map((_, i) => i) : [st.head];
    pick.forEach(hi => {
      const off = (hi * N + s) * S;
      for (let j = 0; j < n; j++) out[j] += U.WEIGHT[c[off + j]] / pick.length;
    });
    return out;
  }
  function buildControls() {
    controls.textContent = "";
    const L = tl.layers;
    const ls = U.select(L.map(l => l.name), l => { st.layer = l; buildControls(); draw(); });
    ls.value = st.layer; ls.className = "qkv-tl-layer";
    const heads = L[st.layer].heads;
    const hs = U.select(["mean of heads", ...heads.map(h => "head " + h)], h => { st.head = h - 1; draw(); });
    hs.value = st.head + 1; hs.className = "qkv-tl-head";
    const slider = U.el("input", "qkv-tl-step");
    slider.type = "range"; slider.min = 0; slider.max = N - 1; slider.value = st.step;
    slider.title = "decoding step";
    slider.addEventListener("input", () => { st.step = +slider.value; draw(); });
    const button = (label, cls, fn) => {
      const b = U.el("button", cls, label); b.type = "button"; b.addEventListener("click", fn); return b;
    };
    const prev = button("\u25c0", "qkv-tl-prev", () => go(st.step - 1));
    const next = button("\u25b6", "qkv-tl-next", () => go(st.step + 1));
    const play = button("play", "qkv-tl-play", () => {
      if (st.timer) { clearInterval(st.timer); st.timer = 0; play.textContent = "play"; return; }
      if (st.step >= N - 1) go(0);
      play.textContent = "pause";
      st.timer = setInterval(() => {
        if (st.step >= N - 1) { clearInterval(st.timer); st.timer = 0; play.textContent = "play"; return; }
        go(st.step + 1);
      }, 600);
    });
    controls.append(U.el("span", "", "Layer:"), ls, U.el("span", "", "Heads:"), hs,
      U.el("span", "", "Step:"), prev, slider, next, play);
  }
  function go(s) {
    st.step = Math.max(0, Math.min(N - 1, s));
    controls.querySelector("input.qkv-tl-step").value = st.step;
    draw();
  }
  function draw() {
    const s = st.step, w = row(s), q = P - 1 + s;
    let top = 0, best = 0;
    w.forEach((x, j) => { if (x > best) { best = x; top = j; } });
    text.textContent = "";
    for (let j = 0; j <= P + s; j++) {
      const span = U.el("span", "qkv-tl-tok" + (j < P ? " qkv-tl-prompt" : " qkv-tl-gen"), tl.labels[j]);
      span.dataset.index = j;
      if (j === P + s) { // the token this step chose: not attended to yet
        span.classList.add("qkv-tl-new");
        span.title = `position ${j}: chosen at this step`;
      } else {
        const v = Math.round(255 * Math.sqrt(best > 0 ? w[j] / best : 0));
        span.style.background = `rgb(${U.RAMP[v * 3]},${U.RAMP[v * 3 + 1]},${U.RAMP[v * 3 + 2]})`;
        span.style.color = v > 150 ? "#111" : "#fff";
        span.title = `position ${j}: weight ${w[j].toPrecision(3)}`;
        if (j === q) span.classList.add("qkv-tl-query");
      }
      text.appendChild(span);
    }
    const h = st.head < 0 ? "mean of heads" : "head " + tl.layers[st.layer].heads[st.head];
    info.textContent = `step ${s + 1} of ${N}: query "${tl.labels[q]}" (position ${q}) attends over ` +
      `${P + s} tokens and chooses "${tl.labels[P + s]}"; strongest: "${tl.labels[top]}" ` +
      `(position ${top}, ${best.toPrecision(3)}); ${tl.layers[st.layer].name}, ${h}`;
    paintHeat();
    panel.dataset.step = s;
    panel.dataset.layer = st.layer;
    panel.dataset.head = st.head;
    panel.dataset.top = top;
    panel.dataset.shown = P + s + 1;
  }
  function paintHeat() { // every step × key, each row scaled to its own maximum
    heat.width = S; heat.height = N;
    heat.style.width = Math.min(720, Math.max(240, S * 6)) + "px";
    heat.style.height = Math.min(320, Math.max(60, N * 8)) + "px";
    const ctx = heat.getContext("2d"), img = ctx.createImageData(S, N);
    for (let s = 0; s < N; s++) {
      const w = row(s), m = Math.max(...w) || 1;
      for (let j = 0; j < S; j++) {
        const p = (s * S + j) * 4, v = j < w.length ? Math.round(255 * Math.sqrt(w[j] / m)) : -1;
        if (v < 0) { img.data[p] = img.data[p + 1] = img.data[p + 2] = 245; }
        else { img.data[p] = U.RAMP[v * 3]; img.data[p + 1] = U.RAMP[v * 3 + 1]; img.data[p + 2] = U.RAMP[v * 3 + 2]; }
        img.data[p + 3] = s === st.step ? 255 : 150;
      }
    }
    ctx.putImageData(img, 0, 0);
  }
  heat.title = "rows: steps, columns: positions; click a row to go to that step";
  heat.addEventListener("click", ev => {
    const r = heat.getBoundingClientRect();
    go(Math.floor((ev.clientY - r.top) / r.height * N));
  });
  note.textContent = `${P} prompt tokens, ${N} generated with the KV cache. Each step's weights ` +
    "are those of the cached call (the new query over every cached key), shaded relative to " +
    "the step's strongest key (square-root scale). Below: all steps (rows) × positions.";
  buildControls();
  return { draw };
}
