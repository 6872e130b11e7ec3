// Neuron view (inlined after viewer.js, inside the same closure): for one query/key pair of
// one head, the D terms q_i[d]·k_j[d]·scale whose sum is the pre-softmax score, and the
// query's scores over every key. Data: neuron.py's neuron_page_layers (float32 q and k).
function NeuronView(panel, data, U) {
  const layers = data.neuron;
  const st = { layer: 0, head: 0, q: layers[0].T - 1, k: 0 }; // the last query: it sees every key
  const controls = U.el("div", "qkv-controls"), pair = U.el("div", "qkv-neuron-pair");
  const keys = U.el("div", "qkv-neuron-keys"), note = U.el("div", "qkv-note");
  panel.append(controls, pair, U.el("div", "qkv-title qkv-sub", "This query's scores over every key (click one):"), keys, note);

  function sides(name) { // the label sides of a layer, from its group
    const g = data.groups.find(g => g.layers.some(l => l.name === name));
    return g ? [data.tokens[g.q], data.tokens[g.k], g.kind] : [[], [], "self"];
  }
  function vectors(l) { // Float32Array views, decoded on first use
    if (!l._q) { l._q = new Float32Array(U.bytes(l.q).buffer); l._k = new Float32Array(U.bytes(l.k).buffer); }
    return l;
  }
  function layer() { return vectors(layers[st.layer]); }
  function qv(l, i) { const o = (st.head * l.T + i) * l.D; return l._q.subarray(o, o + l.D); }
  function kv(l, j) { const o = (st.head * l.S + j) * l.D; return l._k.subarray(o, o + l.D); }
  function score(l, i, j) { const q = qv(l, i), k = kv(l, j); let s = 0; for (let d = 0; d < l.D; d++) s += q[d] * k[d] * l.scale; return s; }
  function label(list, i) { return list[i] === undefined ? String(i) : list[i]; }

  function buildControls() {
    controls.textContent = "";
    const l = layers[st.layer], [ql, kl] = sides(l.name);
    const pick = (text, cls, options, value, fn) => {
      const s = U.select(options, fn); s.value = value; s.className = cls;
      controls.append(U.el("span", "", text), s);
    };
    pick("Layer:", "qkv-n-layer", layers.map(x => x.name), st.layer, v => {
      st.layer = v; st.head = 0; st.q = layers[v].T - 1; st.k = 0; buildControls(); draw();
    });
    pick("Head:", "qkv-n-head", l.heads.map(h => "head " + h), st.head, v => { st.head = v; draw(); });
    pick("Query:", "qkv-n-query", Array.from({ length: l.T }, (_, i) => `${i}: ${label(ql, i)}`), st.q,
      v => { st.q = v; draw(); });
    pick("Key:", "qkv-n-key", Array.from({ length: l.S }, (_, j) => `${j}: ${label(kl, j)}`), st.k,
      v => { st.k = v; draw(); });
  }
  function cells(tr, values, big) { // one row of D coloured cells, value in the tooltip
    const m = Math.max(1e-30, ...Array.from(values, Math.abs));
    values.forEach((v, d) => {
      const c = U.el("td", "qkv-cell"), a = Math.min(1, Math.abs(v) / m);
      c.style.background = v >= 0 ? `rgba(214, 39, 40, ${a.toFixed(3)})` : `rgba(31, 119, 180, ${a.toFixed(3)})`;
      c.title = `d = ${d}: ${v.toPrecision(6)}`;
      c.dataset.value = v;
      if (big) c.classList.add("qkv-term");
      tr.appendChild(c);
    });
  }
  function draw() {
    const l = layer(), [ql, kl, kind] = sides(l.name), i = st.q, j = st.k;
    const q = qv(l, i), k = kv(l, j), terms = Array.from(q, (x, d) => x * k[d] * l.scale);
    let sum = 0;
    terms.forEach(t => { sum += t; });
    pair.textContent = "";
    const table = U.el("table", "qkv-neuron-table");
    [["q", `query ${i}: ${label(ql, i)}`, Array.from(q), false],
     ["k", `key ${j}: ${label(kl, j)}`, Array.from(k), false],
     ["q\u00d7k\u00d7scale", `terms (scale ${l.scale.toPrecision(4)})`, terms, true]].forEach(([name, what, v, big]) => {
      const tr = U.el("tr", "qkv-n-" + name.charAt(0));
      tr.append(U.el("th", "", name), U.el("td", "qkv-n-what", what));
      cells(tr, v, big);
      table.appendChild(tr);
    });
    pair.appendChild(table);
    const hidden = kind === "causal self" && j > i + (l.S - l.T);
    const out = U.el("div", "qkv-score", `\u03a3 over ${l.D} dimensions = ${sum.toPrecision(6)}` +
      ` = pre-softmax score of query ${i} for key ${j}` + (hidden ? " (hidden by the causal mask)" : ""));
    out.dataset.score = sum;
    pair.appendChild(out);
    // Every key's score for this query, as bars; the chosen key outlined.
    keys.textContent = "";
    const all = Array.from({ length: l.S }, (_, jj) => score(l, i, jj));
    const m = Math.max(1e-30, ...all.map(Math.abs));
    all.forEach((s, jj) => {
      const gone = kind === "causal self" && jj > i + (l.S - l.T); // hidden by the causal mask
      const r = U.el("div", "qkv-n-row" + (jj === j ? " qkv-picked" : "") + (gone ? " qkv-n-hidden" : ""));
      if (gone) r.title = "hidden by the causal mask: this score is never used";
      const bar = U.el("span", "qkv-n-bar");
      bar.style.width = (60 * Math.abs(s) / m).toFixed(1) + "px";
      bar.style.background = s >= 0 ? "#d62728" : "#1f77b4";
      r.append(U.el("span", "qkv-n-lab", label(kl, jj)), bar, U.el("span", "qkv-n-val", s.toFixed(4)));
      r.dataset.index = jj;
      r.addEventListener("click", () => { st.k = jj; controls.querySelector("select.qkv-n-key").value = jj; draw(); });
      keys.appendChild(r);
    });
    panel.dataset.layer = st.layer;
    panel.dataset.pair = `${st.head},${i},${j}`;
  }
  note.textContent = "q and k after rotary positions (hook_q, hook_k); red positive, blue negative, " +
    "each row scaled to its largest magnitude. Masks, ALiBi and other biases are added after this sum." +
    (data.neuronLeftOut && data.neuronLeftOut.length ? ` Left out for the page's size: ${data.neuronLeftOut.join(", ")}.` : "");
  buildControls();
  return { draw };
}
