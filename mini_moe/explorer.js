// The routing explorer of the online book (mini_moe/explorer.py, issue 38): plain JavaScript, no
// library, no network. It reads the JSON that mini_moe.explorer.export computed from trained models
// (in a <script type="application/json" class="mme-data"> inside each .mini-moe-explorer element)
// and draws one view at a time: the image's patches coloured by their expert, the combine weight
// as opacity, patches that reached no expert in black with a white cross (for a model with null
// experts: each patch's count of real experts, 0 for null experts only), each expert's load
// against its capacity, Soft MoE's slot mixing weights, and a line of numbers. Every control is a
// native <select> or <input type="range">, so the keyboard works as everywhere else.
// After each drawing the root element's data-state holds the drawn state as JSON (the browser
// check of .ci/browser_check.py reads it, and each patch's data-expert).
(function () {
  "use strict";
  // Okabe and Ito's colour-blind-safe palette without its black (black marks unrouted patches);
  // the same as mini_moe.explorer.PALETTE.
  var PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999"];
  // With null experts a patch shows its count of real experts, from PALE (0) to DARK (all E).
  var PALE = [255, 255, 217], DARK = [8, 29, 88];
  var SVG = "http://www.w3.org/2000/svg";
  var PIXELS = 280; // drawn size of the image, in CSS pixels

  function blend(from, to, t) {
    return "rgb(" + from.map(function (a, j) { return Math.round(a + (to[j] - a) * t); }).join(",") + ")";
  }

  function el(tag, attrs, parent, ns) {
    var node = ns ? document.createElementNS(SVG, tag) : document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function colour(expert) { return PALETTE[expert % PALETTE.length]; }

  function percent(x, digits) { return (100 * x).toFixed(digits === undefined ? 1 : digits) + "%"; }

  // A grey image (base64 bytes, size x size) as a PNG data URL, through a canvas.
  function imageUrl(b64, size) {
    var bytes = atob(b64), canvas = document.createElement("canvas");
    canvas.width = size; canvas.height = size;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(size, size);
    for (var i = 0; i < size * size; i++) {
      var v = bytes.charCodeAt(i);
      img.data[4 * i] = v; img.data[4 * i + 1] = v; img.data[4 * i + 2] = v; img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    return canvas.toDataURL("image/png");
  }

  function control(form, id, text, tag) {
    var wrap = el("span", { "class": "mme-control" }, form);
    var label = el("label", { "for": id }, wrap);
    label.textContent = text;
    return el(tag || "select", { id: id }, wrap);
  }

  function option(select, value, text) {
    var o = el("option", { value: String(value) }, select);
    o.textContent = text;
    return o;
  }

  function mount(root) {
    if (root.getAttribute("data-mounted")) return;
    root.setAttribute("data-mounted", "1");
    var data = JSON.parse(root.querySelector("script.mme-data").textContent);
    var names = Object.keys(data.models), id = root.id;
    var form = el("div", { "class": "mme-controls", role: "group", "aria-label": "routing explorer controls" }, root);

    var modelSel = control(form, id + "-model", "Router ");
    var byDataset = {};
    names.forEach(function (name) {
      var m = data.models[name];
      if (!byDataset[m.dataset]) byDataset[m.dataset] = el("optgroup", { label: m.dataset }, modelSel);
      option(byDataset[m.dataset], name, m.label);
    });
    var capSel = control(form, id + "-capacity", "Capacity factor ");
    var layerSel = control(form, id + "-layer", "MoE layer ");
    var imageIn = control(form, id + "-image", "Test image ", "input");
    imageIn.type = "range"; imageIn.min = "0"; imageIn.step = "1";
    var imageOut = el("output", { "for": id + "-image" }, imageIn.parentNode);
    var slotSel = control(form, id + "-slot", "Soft MoE slot ");

    var figure = el("div", { "class": "mme-figure" }, root);
    var picture = el("svg", { width: PIXELS, height: PIXELS, viewBox: "0 0 " + PIXELS + " " + PIXELS,
                              role: "img", "class": "mme-patches" }, figure, true);
    var loads = el("svg", { width: 360, height: PIXELS, viewBox: "0 0 360 " + PIXELS, role: "img",
                            "class": "mme-loads" }, figure, true);
    var legend = el("p", { "class": "mme-legend" }, root);
    var numbers = el("p", { "class": "mme-numbers", "aria-live": "polite" }, root);
    var urls = {};
    var draws = 0;

    function model() { return data.models[modelSel.value]; }

    // The options that depend on the model: capacities, layers, images, slots.
    function refill() {
      var m = model();
      capSel.innerHTML = "";
      if (m.capacities[0] === null) {
        option(capSel, "none", m.slots_per_expert ? "none (Soft MoE has slots)" : "none (dropless)");
        capSel.disabled = true;
      } else {
        m.capacities.forEach(function (c) { option(capSel, String(c), "c = " + c); });
        capSel.disabled = false;
        capSel.value = String(m.trained_capacity);  // a model opens at the factor it was trained with
      }
      var layer = Math.min(Number(layerSel.value || 0), m.layers - 1);
      layerSel.innerHTML = "";
      for (var l = 0; l < m.layers; l++) option(layerSel, l, String(l + 1) + " of " + m.layers);
      layerSel.value = String(layer);
      var count = data.datasets[m.dataset].images.length;
      imageIn.max = String(count - 1);
      if (Number(imageIn.value) > count - 1) imageIn.value = "0";
      slotSel.innerHTML = "";
      option(slotSel, "-1", "off: patches by expert");
      if (m.slots_per_expert) {
        for (var e = 0; e < m.num_experts; e++)
          for (var s = 0; s < m.slots_per_expert; s++) option(slotSel, e * m.slots_per_expert + s, "expert " + e + ", slot " + s);
      }
      slotSel.disabled = !m.slots_per_expert;
    }

    function view() {
      var m = model();
      return m.views[m.capacities[0] === null ? "none" : capSel.value][Number(layerSel.value)][Number(imageIn.value)];
    }

    function draw() {
      var m = model(), v = view(), ds = data.datasets[m.dataset], side = m.side, cell = PIXELS / side;
      var image = Number(imageIn.value), slot = Number(slotSel.value);
      imageOut.textContent = String(image);
      var key = m.dataset + ":" + image;
      if (!urls[key]) urls[key] = imageUrl(ds.images[image], ds.size);
      picture.innerHTML = "";
      el("image", { href: urls[key], x: 0, y: 0, width: PIXELS, height: PIXELS, "image-rendering": "pixelated" }, picture, true);
      var slotMax = 0;
      if (slot >= 0) {
        for (var p = 0; p < side * side; p++) slotMax = Math.max(slotMax, v.slots[p * m.num_experts * m.slots_per_expert + slot]);
      }
      var unrouted = 0, nullOnly = 0;
      for (var r = 0; r < side; r++) {
        for (var c = 0; c < side; c++) {
          var i = r * side + c, e = v.expert[i], w = v.weight[i] / 100;
          var rect = el("rect", { x: c * cell, y: r * cell, width: cell, height: cell, "class": "mme-patch",
                                  "data-row": r, "data-col": c, "data-expert": e, "data-weight": v.weight[i],
                                  stroke: "#ffffff", "stroke-width": 1 }, picture, true);
          if (slot >= 0) { // Soft MoE: how much of this patch the chosen slot mixes in
            var mix = v.slots[i * m.num_experts * m.slots_per_expert + slot];
            rect.setAttribute("fill", colour(Math.floor(slot / m.slots_per_expert)));
            rect.setAttribute("fill-opacity", slotMax > 0 ? (0.9 * mix / slotMax).toFixed(3) : "0");
            rect.setAttribute("data-mix", mix);
          } else if (m.null_experts && !(e < 0 && !v.null_only[i])) { // the count of real experts, null-only: 0
            var count = v.experts[i], shade = count / m.num_experts;
            if (v.null_only[i]) nullOnly++;
            rect.setAttribute("fill", blend(PALE, DARK, shade));
            rect.setAttribute("fill-opacity", "0.85");
            rect.setAttribute("data-real", count);
            var n = el("text", { x: c * cell + cell / 2, y: r * cell + cell / 2 + 5, "text-anchor": "middle",
                                 "font-size": 14, fill: shade > 0.5 ? "#ffffff" : "#000000" }, picture, true);
            n.textContent = String(count);
          } else if (e < 0) {
            unrouted++;
            rect.setAttribute("fill", "#000000");
            rect.setAttribute("fill-opacity", "0.75");
            el("path", { d: "M" + (c * cell + 0.2 * cell) + " " + (r * cell + 0.2 * cell) + " l" + 0.6 * cell + " " + 0.6 * cell +
                         " m0 " + (-0.6 * cell) + " l" + (-0.6 * cell) + " " + 0.6 * cell, stroke: "#ffffff", "stroke-width": 2 }, picture, true);
          } else {
            rect.setAttribute("fill", colour(e));
            rect.setAttribute("fill-opacity", (0.15 + 0.65 * w).toFixed(3));
            var t = el("text", { x: c * cell + cell / 2, y: r * cell + cell / 2 + 5, "text-anchor": "middle",
                                 "font-size": 14, fill: "#000000" }, picture, true);
            t.textContent = String(e) + (v.experts[i] > 1 ? " +" + (v.experts[i] - 1) : "");
          }
        }
      }
      picture.setAttribute("aria-label", slot >= 0 ?
        "mixing weights of slot " + (slot % m.slots_per_expert) + " of expert " + Math.floor(slot / m.slots_per_expert) :
        (m.null_experts ? "real experts per patch; " + nullOnly + " of " + side * side + " patches picked null experts only; " :
         "patches coloured by expert; ") + unrouted + " of " + side * side + " patches " +
        (m.null_experts ? "dropped" : "reached no expert"));
      drawLoads(m, v);
      legend.innerHTML = "";
      if (m.null_experts) { // a count per patch, not an expert: a scale from 0 to E instead of the experts' colours
        [0, m.num_experts].forEach(function (count) {
          var end = el("span", { "class": "mme-key" }, legend);
          el("span", { "class": "mme-swatch", style: "background:" + blend(PALE, DARK, count / m.num_experts) }, end);
          end.appendChild(document.createTextNode(count + " real experts" + (count ? " " : " (null experts only, not dropped) ")));
        });
      }
      for (var k = 0; k < (m.null_experts ? 0 : m.num_experts); k++) {
        var item = el("span", { "class": "mme-key" }, legend);
        el("span", { "class": "mme-swatch", style: "background:" + colour(k) }, item);
        item.appendChild(document.createTextNode("expert " + k + " "));
      }
      var black = el("span", { "class": "mme-key" }, legend);
      el("span", { "class": "mme-swatch", style: "background:#000" }, black);
      black.appendChild(document.createTextNode(m.capacities[0] === null ? "reached no expert" : "dropped (no expert)"));
      numbers.textContent = "Tokens of the routing group that reached no expert: " + percent(v.dropped) +
        (m.null_experts ? "; patches with null experts only: " + percent(v.null_share) + "; real experts per token: " :
         "; experts per token: ") + v.experts_per_token.toFixed(2) +
        "; this model's test accuracy: " + (m.accuracy === null ? "not measured" : percent(m.accuracy)) + ".";
      draws++;
      root.setAttribute("data-draws", String(draws));
      root.setAttribute("data-state", JSON.stringify({ model: modelSel.value, capacity: capSel.value,
        layer: Number(layerSel.value), image: image, slot: slot, expert: v.expert, dropped: v.dropped }));
    }

    function drawLoads(m, v) {
      loads.innerHTML = "";
      var left = 40, bottom = PIXELS - 30, top = 20, width = 360 - left - 10;
      var capacity = m.capacity ? m.capacity[capSel.value] : null;
      var most = Math.max.apply(null, v.load.concat([capacity || 0, 1]));
      var bar = width / m.num_experts;
      for (var e = 0; e < m.num_experts; e++) {
        var h = (bottom - top) * v.load[e] / most;
        el("rect", { x: left + e * bar + 2, y: bottom - h, width: bar - 4, height: h, fill: colour(e),
                     "class": "mme-load", "data-load": v.load[e] }, loads, true);
        var t = el("text", { x: left + e * bar + bar / 2, y: bottom + 14, "text-anchor": "middle", "font-size": 11 }, loads, true);
        t.textContent = String(e);
      }
      if (capacity !== null) {
        var y = bottom - (bottom - top) * capacity / most;
        el("line", { x1: left, x2: left + width, y1: y, y2: y, stroke: "#000", "stroke-dasharray": "5 3" }, loads, true);
        var label = el("text", { x: left + width, y: y - 4, "text-anchor": "end", "font-size": 11 }, loads, true);
        label.textContent = "capacity C = " + capacity;
      }
      var axis = el("text", { x: left + width / 2, y: PIXELS - 2, "text-anchor": "middle", "font-size": 11 }, loads, true);
      axis.textContent = "expert: tokens of the routing group it processes";
      el("line", { x1: left, x2: left + width, y1: bottom, y2: bottom, stroke: "#000" }, loads, true);
      var most_label = el("text", { x: left - 4, y: top + 4, "text-anchor": "end", "font-size": 11 }, loads, true);
      most_label.textContent = String(most);
      loads.setAttribute("aria-label", "load per expert: " + v.load.join(", ") + (capacity !== null ? "; capacity " + capacity : ""));
    }

    modelSel.addEventListener("change", function () { refill(); draw(); });
    [capSel, layerSel, slotSel].forEach(function (s) { s.addEventListener("change", draw); });
    imageIn.addEventListener("input", draw);
    imageIn.addEventListener("change", draw);
    imageIn.value = "0";
    refill();
    draw();
  }

  function mountAll() {
    var roots = document.querySelectorAll(".mini-moe-explorer");
    for (var i = 0; i < roots.length; i++) {
      try { mount(roots[i]); } catch (err) { roots[i].setAttribute("data-error", String(err)); throw err; }
    }
  }

  if (!document.getElementById("mini-moe-explorer-style")) {
    var style = el("style", { id: "mini-moe-explorer-style" }, document.head);
    style.textContent = ".mini-moe-explorer{margin:1em 0;font-size:0.95em}" +
      ".mme-controls{display:flex;flex-wrap:wrap;gap:0.5em 1.2em;margin-bottom:0.5em}" +
      ".mme-control label{margin-right:0.3em}.mme-figure{display:flex;flex-wrap:wrap;gap:1em}" +
      ".mme-legend{display:flex;flex-wrap:wrap;gap:0.2em 0.8em}.mme-key{white-space:nowrap}.mme-swatch{display:inline-block;width:0.9em;height:0.9em;" +
      "margin-right:0.25em;vertical-align:middle;border:1px solid #555}";
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", mountAll);
  else mountAll();
})();
