// The run page's script (served from /static/run.js: the Content-Security-Policy runs scripts of
// this origin only, and no inline handler). It zooms the drawing, asks before a cancel, a clear,
// a mark or a rerun (the buttons' data-confirm), and keeps the page current without reloading
// it: every few seconds it asks
// /api/runs/RUN_ID/changes?after=LAST_EVENT_ID what changed (bounded: at most 500 ledger rows
// a time) and updates the run's state and counts, the rows of the tasks shown, the drawn boxes
// (a task's state, a group's counts, a map's children's counts) and the ledger. A map's box
// (g.node.map) expands on a click: its children drawn below the DAG (?part=map&key=KEY). A folded
// task group's box (g.node.group) opens on a click: the drawing is fetched again with the group
// drawn task by task (?part=dag&expand=GROUP,...), and the polls ask for the boxes of that drawing;
// the "fold groups" button folds them all again.
(function () {
  'use strict';
  var POLL_MS = 3000;
  var PROGRESS_POLL_MS = 700;
  var LEDGER_KEEP = 500;
  var COLOURS = {
    PENDING: '#f0f0f0', READY: '#d6e4f0', QUEUED: '#b0c4de', RUNNING: '#7fd67f', RETRYING: '#f5d742',
    SUCCEEDED: '#2e8b57', FAILED: '#e0443e', UPSTREAM_FAILED: '#f29d49', SKIPPED: '#f4a6d7',
    CANCELLED: '#a9a9a9', DEAD_LETTER: '#8b1a1a', MAPPED: '#8fd3c1', WAITING: '#c7b8ea',
    MIXED: '#ffffff'
  };
  var DARK = { SUCCEEDED: 1, FAILED: 1, DEAD_LETTER: 1 };
  var BOX_W = 170, BOX_H = 46;
  var SVG_NS = 'http://www.w3.org/2000/svg';
  var scale = 1;
  var openGroups = [];  // the task groups drawn task by task (the others are one box each)

  function zoom(f) {
    var svg = document.querySelector('#dag svg');
    if (!svg) return;
    var box = svg.getAttribute('viewBox').split(' ');
    var w = +box[2], h = +box[3];
    scale = f === 0 ? Math.min(1, document.getElementById('dag').clientWidth / w) : scale * f;
    svg.setAttribute('width', Math.round(w * scale));
    svg.setAttribute('height', Math.round(h * scale));
  }

  function fmt(n) { return Number(n).toLocaleString('en-US'); }

  function text(el, value) { if (el) el.textContent = value; }

  function paintTask(key, t) {
    var g = document.querySelector('#dag g.node[data-key="' + CSS.escape(key) + '"]');
    if (!g) return;
    g.setAttribute('data-state', t.state);
    var rect = g.querySelector('rect');
    if (rect) rect.setAttribute('fill', COLOURS[t.state] || '#fff');
    var ink = DARK[t.state] ? '#ffffff' : '#111111';
    g.querySelectorAll('text').forEach(function (x) { x.setAttribute('fill', ink); });
    if (t.skip_reason) g.setAttribute('data-skip', t.skip_reason);
    var sub = g.querySelector('text.sub');
    if (g.getAttribute('data-kind') === 'map') {
      // a map's box counts its children (paintBox); before it expands, or ended without any, its state
      if (sub && !+g.getAttribute('data-total')) {
        text(sub, t.skip_reason ? 'skipped: ' + t.skip_reason : t.state.toLowerCase());
      }
      return;
    }
    if (sub) {
      var again = t.attempt > 1 ? ' #' + t.attempt : '';
      var rule = g.getAttribute('data-rule');
      text(sub, t.skip_reason ? 'skipped: ' + t.skip_reason
        : t.state.toLowerCase() + again + (rule && rule !== 'all_success' ? ' \u00b7 ' + rule : ''));
    }
  }

  function short(s, n) { return s.length > n ? s.slice(0, n - 1) + '\u2026' : s; }

  function paintBox(id, b) {
    var g = document.getElementById(id);
    if (!g) return;
    var states = Object.keys(b.counts).sort();
    g.setAttribute('data-state', b.state);
    g.setAttribute('data-counts', states.map(function (s) { return s + ':' + b.counts[s]; }).join(','));
    var rect = g.querySelector('rect');
    if (rect) rect.setAttribute('fill', COLOURS[b.state] || '#fff');
    var ink = DARK[b.state] ? '#ffffff' : '#111111';
    g.querySelectorAll('text').forEach(function (x) { x.setAttribute('fill', ink); });
    text(g.querySelector('title'), b.title);
    var biggest = states.slice().sort(function (a, c) { return b.counts[c] - b.counts[a] || (a < c ? -1 : 1); });
    var sub = biggest.map(function (s) { return fmt(b.counts[s]) + ' ' + s.toLowerCase(); }).join(', ');
    if (b.label !== undefined) {  // a map's box: its label and line come with it
      var total = states.reduce(function (a, s) { return a + b.counts[s]; }, 0);
      g.setAttribute('data-total', total);
      var lines = g.querySelectorAll('text');
      if (lines.length) text(lines[0], short(b.label, 22));
      sub = b.sub;
      if (!total) return;
    }
    text(g.querySelector('text.sub'), short(sub, 30));
    // the strip of shares along the box's foot
    g.querySelectorAll('rect.share').forEach(function (r) { r.remove(); });
    if (!rect) return;
    var x0 = +rect.getAttribute('x'), y0 = +rect.getAttribute('y');
    var total = states.reduce(function (a, s) { return a + b.counts[s]; }, 0) || 1, x = 0;
    var parent = rect.parentNode;
    states.forEach(function (s) {
      var w = (BOX_W - 12) * b.counts[s] / total;
      var r = document.createElementNS(SVG_NS, 'rect');
      r.setAttribute('class', 'share');
      r.setAttribute('data-state', s);
      r.setAttribute('x', (x0 + 6 + x).toFixed(1));
      r.setAttribute('y', y0 + BOX_H - 8);
      r.setAttribute('width', w.toFixed(1));
      r.setAttribute('height', 4);
      r.setAttribute('fill', COLOURS[s] || '#fff');
      parent.appendChild(r);
      x += w;
    });
  }

  function waitText(w) {
    if (w.kind === 'approval') return 'an approval';
    if (w.event) return 'event ' + w.event + (w.match ? ' matching ' + JSON.stringify(w.match) : '');
    return w.kind + (w.until ? ' until ' + w.until : '');
  }

  function paintRow(key, t) {
    var row = document.getElementById('task-' + key);
    if (!row) return;  // not on this page of the table
    row.setAttribute('data-state', t.state);
    if (row.getAttribute('data-attempt') !== String(t.attempt)) {  // another attempt: not its progress
      row.setAttribute('data-attempt', String(t.attempt));
      text(row.querySelector('.c-progress'), '');
    }
    var why = t.skip_reason ? ' skipped: ' + t.skip_reason : '';
    if (t.map) {
      why = ' mapped into ' + fmt(t.map.total) + ' task(s): ' + fmt(t.map.done) + ' done (' + fmt(t.map.succeeded) +
        ' succeeded, ' + fmt(t.map.failed) + ' failed, ' + fmt(t.map.skipped) + ' skipped)';
    }
    text(row.querySelector('.c-state'), t.state + why);
    text(row.querySelector('.c-attempt'), t.attempt + '/' + t.max_attempts);
    text(row.querySelector('.c-duration'), t.duration === null ? '-' : t.duration.toFixed(2) + 's');
    text(row.querySelector('.c-worker'), t.worker || '');
    var cell = row.querySelector('.c-error');
    if (cell) {
      // a waiting reason is stale once the task moved on
      cell.textContent = t.error || (t.waiting ? 'waiting for ' + waitText(t.waiting) : '');
    }
    row.querySelectorAll('form.approval').forEach(function (f) {
      f.hidden = !(t.state === 'WAITING' && t.waiting && t.waiting.kind === 'approval');
    });
  }

  function paintProgress(key, p) {
    var row = document.getElementById('task-' + key);
    if (!row) return;
    var meta = p.meta === null || p.meta === undefined ? '' : ' ' + JSON.stringify(p.meta);
    text(row.querySelector('.c-progress'), short(p.state + meta, 120));
  }

  function paintCounts(counts) {
    var p = document.getElementById('counts');
    if (!p) return;
    var live = document.getElementById('live');
    var total = 0;
    Object.keys(counts).forEach(function (s) { total += counts[s]; });
    while (p.firstChild && p.firstChild !== live) p.removeChild(p.firstChild);
    p.insertBefore(document.createTextNode(fmt(total) + ' tasks: '), live);
    Object.keys(counts).sort().forEach(function (s) {
      var a = document.createElement('a');
      a.className = 'count';
      a.setAttribute('data-state', s);
      a.href = '?state=' + encodeURIComponent(s) + '#tasks';
      a.textContent = fmt(counts[s]) + ' ' + s.toLowerCase();
      p.insertBefore(a, live);
      p.insertBefore(document.createTextNode(' '), live);
    });
  }

  function addEvents(events) {
    var table = document.getElementById('ledger');
    if (!table || table.getAttribute('data-frozen')) return;  // an older page stays as it was
    var body = table.tBodies[0] || table;
    events.forEach(function (e) {
      if (body.querySelector('tr[data-id="' + e.id + '"]')) return;
      var tr = document.createElement('tr');
      tr.setAttribute('data-id', e.id);
      if (!e.accepted) tr.style.color = '#a00';
      var to = e.to + (e.accepted ? '' : ' (refused)') + (e.kind ? ' ' + e.kind : '');
      [e.at || '', e.key || '(run)', e.attempt, e.from || '', to, e.actor, e.by || '', e.reason || ''].forEach(
        function (v) { var td = document.createElement('td'); td.textContent = String(v); tr.appendChild(td); });
      body.appendChild(tr);
    });
    var rows = body.querySelectorAll('tr[data-id]');
    for (var i = 0; i < rows.length - LEDGER_KEEP; i++) rows[i].remove();
  }

  function poll(root) {
    var run = root.getAttribute('data-run');
    var after = root.getAttribute('data-after');
    fetch('/api/runs/' + encodeURIComponent(run) + '/changes?after=' + encodeURIComponent(after) +
          (openGroups.length ? '&expand=' + encodeURIComponent(openGroups.join(',')) : ''),
          { credentials: 'same-origin', headers: { Accept: 'application/json' } })
      .then(function (r) { if (!r.ok) throw new Error('changes: ' + r.status); return r.json(); })
      .then(function (c) {
        Object.keys(c.tasks).forEach(function (key) { paintTask(key, c.tasks[key]); paintRow(key, c.tasks[key]); });
        Object.keys(c.boxes).forEach(function (id) { paintBox(id, c.boxes[id]); });
        var reporting = Object.keys(c.progress || {});
        reporting.forEach(function (key) { paintProgress(key, c.progress[key]); });
        paintCounts(c.counts);
        addEvents(c.events);
        text(document.getElementById('run-state'), c.run.state);
        root.setAttribute('data-after', c.last);
        root.setAttribute('data-polls', +(root.getAttribute('data-polls') || 0) + 1);
        if (c.more) { setTimeout(function () { poll(root); }, 50); return; }
        if (c.run.final) {
          root.setAttribute('data-final', '1');
          text(document.getElementById('live'), 'finished');
          document.querySelectorAll('#cancel-run').forEach(function (b) { b.disabled = true; });
          return;
        }
        // while tasks run, what their bodies report (update_state) is shown within a second
        var busy = reporting.length || (c.run && c.counts && c.counts.RUNNING);
        setTimeout(function () { poll(root); }, busy ? PROGRESS_POLL_MS : POLL_MS);
      })
      .catch(function () { setTimeout(function () { poll(root); }, POLL_MS * 3); });
  }

  function expand(root, g) {
    // a map's box clicked: draw its children below the DAG (a second click on it hides them)
    var view = document.getElementById('map-view');
    var key = g.getAttribute('data-key');
    if (!view || !root) return;
    if (!view.hidden && view.getAttribute('data-map') === key) { view.hidden = true; return; }
    fetch('/runs/' + encodeURIComponent(root.getAttribute('data-run')) + '?part=map&key=' + encodeURIComponent(key),
          { credentials: 'same-origin' })
      .then(function (r) { if (!r.ok) throw new Error('map: ' + r.status); return r.text(); })
      .then(function (svg) {
        view.innerHTML = svg;
        view.setAttribute('data-map', key);
        view.hidden = false;
        view.scrollIntoView({ block: 'nearest' });
      })
      .catch(function (e) { view.textContent = String(e); view.hidden = false; });
  }

  function redraw(root) {
    // the drawing again with openGroups drawn task by task (the states as of now: the polls go on)
    var dag = document.getElementById('dag');
    if (!dag || !root) return;
    var url = '/runs/' + encodeURIComponent(root.getAttribute('data-run')) + '?part=dag' +
      (openGroups.length ? '&expand=' + encodeURIComponent(openGroups.join(',')) : '');
    fetch(url, { credentials: 'same-origin' })
      .then(function (r) { if (!r.ok) throw new Error('drawing: ' + r.status); return r.text(); })
      .then(function (svg) {
        dag.innerHTML = svg;
        dag.setAttribute('data-open', openGroups.join(','));
        var fold = document.getElementById('fold-groups');
        if (fold) fold.hidden = !openGroups.length;
        bind(root);
        zoom(1);
      })
      .catch(function (e) { dag.textContent = String(e); });
  }

  function bind(root) {
    // the clickable boxes of the drawing: a map's (its children) and a folded group's (its tasks)
    document.querySelectorAll('#dag g.node.map').forEach(function (g) {
      g.addEventListener('click', function (e) { e.preventDefault(); expand(root, g); });
    });
    document.querySelectorAll('#dag g.node.group').forEach(function (g) {
      g.addEventListener('click', function (e) {
        e.preventDefault();
        var name = g.getAttribute('data-group');
        if (openGroups.indexOf(name) < 0) openGroups.push(name);
        redraw(root);
      });
    });
  }

  function start() {
    document.querySelectorAll('#fold-groups').forEach(function (b) {
      b.addEventListener('click', function () { openGroups = []; redraw(document.getElementById('run')); });
    });
    document.querySelectorAll('[data-zoom]').forEach(function (b) {
      b.addEventListener('click', function () { zoom(+b.getAttribute('data-zoom')); });
    });
    document.querySelectorAll('[data-confirm]').forEach(function (b) {
      b.addEventListener('click', function (e) { if (!confirm(b.getAttribute('data-confirm'))) e.preventDefault(); });
    });
    var root = document.getElementById('run');
    var dag = document.getElementById('dag');
    var src = dag && dag.getAttribute('data-src');
    if (src) {
      // a large run's page came without its drawing (laying it out takes a while): fetch it
      fetch(src, { credentials: 'same-origin' })
        .then(function (r) { if (!r.ok) throw new Error('drawing: ' + r.status); return r.text(); })
        .then(function (svg) { dag.innerHTML = svg; dag.removeAttribute('data-src'); drawn(root); })
        .catch(function (e) { dag.textContent = String(e); drawn(root); });
    } else {
      drawn(root);
    }
  }

  function drawn(root) {
    if (document.querySelectorAll('#dag g.node').length > 60) zoom(0);
    bind(root);
    if (root) {
      // the marker a browser test waits for: the page and its drawing are drawn, the script runs
      root.setAttribute('data-ready', '1');
      root.setAttribute('data-ready-ms', String(Math.round(performance.now())));
      var running = document.querySelector('tr[data-state="RUNNING"]') ? PROGRESS_POLL_MS : POLL_MS;
      if (root.getAttribute('data-final') !== '1') setTimeout(function () { poll(root); }, running);
    }
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
