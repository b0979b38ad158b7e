/* logdx job page: curves (uPlot), the cascade link, filters, feedback. Talks to nobody but the
   server that sent the page (and to nobody at all in a file opened from disk). */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("job-data").textContent || "{}");

  function marksPlugin(marks) {
    return { hooks: { draw: function (u) {
      var ctx = u.ctx;
      marks.forEach(function (m) {
        var x = u.valToPos(m.step, "x", true);
        if (!isFinite(x)) return;
        ctx.save();
        ctx.strokeStyle = m.recovered ? "#2e9d5b" : "#d0021b";
        ctx.lineWidth = 2 * (window.devicePixelRatio || 1);
        ctx.setLineDash(m.recovered ? [6, 4] : []);
        ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        ctx.fillStyle = ctx.strokeStyle;
        ctx.fillText((m.recovered ? "recovered " : "") + m.kind, x + 4, u.bbox.top + 12);
        ctx.restore();
      });
    } } };
  }

  function drawCurve(el, points, label, color) {
    if (!el || !points || !points.length || typeof uPlot === "undefined") { if (el) el.hidden = !points || !points.length; return; }
    var xs = points.map(function (p) { return p[0]; }), ys = points.map(function (p) { return p[1]; });
    var width = Math.max(320, el.clientWidth || 800);
    new uPlot({
      title: label, width: width, height: 220,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label: label }],
      series: [{ label: "step" }, { label: label, stroke: color, width: 1.5 }],
      plugins: [marksPlugin(data.marks || [])],
    }, [xs, ys], el);
  }
  drawCurve(document.getElementById("loss-chart"), data.loss, "loss", "#1f6feb");
  drawCurve(document.getElementById("step-time-chart"), data.step_time, "seconds per step", "#8250df");

  // The root line in context opens on the root line, in the middle of its box: the box scrolls,
  // never the page (scrollIntoView would move the page down to it).
  var box = document.querySelector("pre.context"), rootLine = box && box.querySelector(".ctx.root");
  if (rootLine) {
    var offset = rootLine.getBoundingClientRect().top - box.getBoundingClientRect().top + box.scrollTop;
    box.scrollTop = Math.max(0, offset - (box.clientHeight - rootLine.offsetHeight) / 2);
  }

  var link = document.getElementById("show-cascade"), lanes = document.querySelector(".lanes");
  function setLinked(on) {
    if (!lanes) return;
    lanes.classList.toggle("linked", on);
    if (link) link.setAttribute("aria-pressed", on ? "true" : "false");
  }
  if (link) link.addEventListener("click", function () { setLinked(!lanes.classList.contains("linked")); });
  var root = document.getElementById("root-marker");
  if (root) {
    root.addEventListener("mouseenter", function () { setLinked(true); });
    root.addEventListener("focus", function () { setLinked(true); });
  }

  // The x axis is the job's lines; zooming re-places every marker over [lo, hi] (hidden outside).
  var zoom = document.getElementById("zoom");
  function placeAll(lo, hi) {
    var span = Math.max(1, hi - lo);
    function pct(line) { return (line - lo) / span * 100; }
    document.querySelectorAll(".track [data-line]").forEach(function (el) {
      var x = pct(+el.dataset.line);
      el.hidden = x < 0 || x > 100;
      el.style.left = x + "%";
    });
    document.querySelectorAll(".track .bar").forEach(function (el) {
      var a = Math.max(0, pct(+el.dataset.first)), b = Math.min(100, pct(+el.dataset.last));
      el.hidden = b < 0 || a > 100;
      el.style.left = a + "%"; el.style.width = Math.max(0.3, b - a) + "%";
    });
    document.querySelectorAll(".axis span").forEach(function (el, i, all) {
      el.textContent = "line " + Math.round(lo + span * i / (all.length - 1));
    });
  }
  if (zoom) zoom.addEventListener("click", function () {
    var on = zoom.getAttribute("aria-pressed") !== "true";
    zoom.setAttribute("aria-pressed", on ? "true" : "false");
    zoom.textContent = on ? "the whole job" : "zoom to the failure";
    if (on) placeAll(+zoom.dataset.from, +zoom.dataset.to); else placeAll(1, +zoom.dataset.lines);
  });

  function filter(inputId, itemSelector) {
    var input = document.getElementById(inputId);
    if (!input) return;
    var items = Array.prototype.slice.call(document.querySelectorAll(itemSelector));
    input.addEventListener("input", function () {
      var q = input.value.trim().toLowerCase();
      items.forEach(function (it) { it.hidden = q !== "" && it.textContent.toLowerCase().indexOf(q) < 0; });
    });
  }
  filter("evidence-search", "li.evidence-item");
  filter("template-search", "tr.template");

  var form = document.getElementById("feedback-form");
  if (form) form.addEventListener("submit", function (e) {
    e.preventDefault();
    var out = document.getElementById("feedback-result");
    var verdict = form.querySelector("input[name=verdict]:checked").value;
    var body = { note: form.elements.note.value || null };
    var path = "/feedback";
    if (verdict === "false_alarm") {
      path = "/false-alarm";
    } else if (verdict === "correct") {
      var pick = form.elements.failure_type.value.split("/");
      body.category = pick[0]; body.failure_type = pick[1];
    } else {
      body.category = form.dataset.category; body.failure_type = form.dataset.failureType;
    }
    fetch("/v1/reports/" + encodeURIComponent(form.dataset.report) + path, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Logdx-Page": "1" }, body: JSON.stringify(body),
    }).then(function (r) {
      return r.json().then(function (j) {
        var thanks = verdict === "false_alarm"
          ? "Recorded as a false alarm" + (j.silence ? ": this root line is silenced (" + j.silence + ")" : "")
          : "Thank you: incident " + j.id + " (" + j.category + " / " + j.failure_type + ")";
        out.textContent = r.ok ? thanks : "Refused: " + ((j.error && j.error.message) || r.status);
        out.className = r.ok ? "ok" : "error";
      });
    }).catch(function (err) { out.textContent = "Not sent: " + err; out.className = "error"; });
  });
})();
