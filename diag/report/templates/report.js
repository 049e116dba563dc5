// diag report: sort any table.sortable by a header click; filter the verdict table.
// Reads only the DOM this file ships with; never builds HTML from cell text.
(function () {
  "use strict";
  var collator = new Intl.Collator(undefined, { numeric: true, sensitivity: "base" });

  // Numeric cells carry data-v: "" (missing), "NaN", "Infinity" or a float. Missing sorts
  // last in both directions; NaN (a garbage result) counts as worse than +inf.
  function numKey(td) {
    var v = td.getAttribute("data-v");
    if (v === null || v === "") return null;
    var x = parseFloat(v);
    return isNaN(x) ? Number.POSITIVE_INFINITY : x;
  }
  function isNanCell(td) { return td.getAttribute("data-v") === "NaN"; }

  function sortTable(table, col, th) {
    var numeric = th.getAttribute("data-type") === "num";
    var current = th.getAttribute("aria-sort");
    // First click: worst first for numbers (largest), A-Z for text.
    var dir = current ? (current === "ascending" ? "descending" : "ascending")
                      : (numeric ? "descending" : "ascending");
    var sign = dir === "ascending" ? 1 : -1;
    // A grouped table sorts within each probe's tbody; its header row stays on top.
    Array.prototype.forEach.call(table.tBodies, function (tbody) {
      sortRows(tbody, col, numeric, sign);
    });
    Array.prototype.forEach.call(th.parentNode.cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", dir);
  }

  function sortRows(tbody, col, numeric, sign) {
    var rows = Array.prototype.filter.call(tbody.rows, function (r) {
      return !r.classList.contains("group-head");
    });
    rows.sort(function (a, b) {
      var ta = a.cells[col], tb = b.cells[col], c = 0;
      if (numeric) {
        var x = numKey(ta), y = numKey(tb);
        if (x === null || y === null) {
          if (x === null && y === null) c = 0; else return x === null ? 1 : -1;
        } else if (x !== y) {
          c = x < y ? -1 : 1;
        } else {
          c = (isNanCell(ta) ? 1 : 0) - (isNanCell(tb) ? 1 : 0);
        }
      } else {
        c = collator.compare(ta.textContent.trim(), tb.textContent.trim());
      }
      if (c === 0) return (+a.getAttribute("data-i")) - (+b.getAttribute("data-i"));
      return sign * c;
    });
    rows.forEach(function (r) { tbody.appendChild(r); });
  }

  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.tabIndex = 0;
      th.addEventListener("click", function () { sortTable(table, col, th); });
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortTable(table, col, th); }
      });
    });
  });

  // A long agreement table starts with its passing rows hidden; one button shows them.
  var agreement = document.getElementById("agreement-table");
  var passing = document.getElementById("agreement-passing");
  function showPassing(show) {
    Array.prototype.forEach.call(agreement.querySelectorAll("tr[data-status='pass']"),
                                 function (r) { r.hidden = !show; });
    passing.setAttribute("aria-pressed", show ? "true" : "false");
    passing.textContent = show ? "hide passing records" : "show passing records";
  }
  if (agreement && passing && agreement.getAttribute("data-hide-passing") === "1") {
    showPassing(false);
    passing.addEventListener("click", function () {
      showPassing(passing.getAttribute("aria-pressed") !== "true");
    });
  }

  var table = document.getElementById("verdict-table");
  var input = document.getElementById("filter");
  var select = document.getElementById("status-filter");
  var counter = document.getElementById("row-count");
  var cellBox = document.getElementById("cell-filter");
  var problems = { warn: true, fail: true, error: true };
  var cell = "";  // a matrix cell's id: only its records are shown

  function recordRows() {
    return table ? table.querySelectorAll("tbody tr[data-i]") : [];
  }

  function applyFilter() {
    if (!table) return;
    var needle = input.value.trim().toLowerCase();
    var want = select.value;
    var rows = recordRows(), shown = 0;
    for (var i = 0; i < rows.length; i++) {
      var r = rows[i], s = r.getAttribute("data-status");
      var ok = (!want || (want === "problems" ? problems[s] :
                          want === "nopass" ? s !== "pass" : s === want)) &&
               (!cell || r.getAttribute("data-cell") === cell) &&
               (!needle || r.textContent.toLowerCase().indexOf(needle) >= 0);
      r.hidden = !ok;
      if (ok) shown++;
    }
    // A probe's header row shows while any of its records passes the filter.
    Array.prototype.forEach.call(table.tBodies, function (tb) {
      var head = tb.querySelector("tr.group-head");
      if (head) head.hidden = !tb.querySelector("tr[data-i]:not([hidden])");
    });
    counter.textContent = "showing " + shown + " of " + rows.length;
    cellBox.hidden = !cell;
    Array.prototype.forEach.call(document.querySelectorAll("#status-counts button"), function (b) {
      b.classList.toggle("active", b.getAttribute("data-status") === want);
    });
  }

  function setGroup(tbody, open) {
    tbody.classList.toggle("collapsed", !open);
    var b = tbody.querySelector("button.group-toggle");
    if (b) b.setAttribute("aria-expanded", open ? "true" : "false");
  }

  if (table) {
    input.addEventListener("input", applyFilter);
    select.addEventListener("change", applyFilter);
    Array.prototype.forEach.call(document.querySelectorAll("#status-counts button"), function (b) {
      b.addEventListener("click", function () {
        var s = b.getAttribute("data-status");
        select.value = select.value === s ? "" : s;
        applyFilter();
        document.getElementById("results").scrollIntoView();
      });
    });
    Array.prototype.forEach.call(table.tBodies, function (tb) {
      var b = tb.querySelector("button.group-toggle");
      if (b) b.addEventListener("click", function () {
        setGroup(tb, tb.classList.contains("collapsed"));
      });
    });
    var all = document.getElementById("groups-toggle");
    all.addEventListener("click", function () {
      var open = all.getAttribute("data-open") !== "1";
      Array.prototype.forEach.call(table.tBodies, function (tb) { setGroup(tb, open); });
      all.setAttribute("data-open", open ? "1" : "0");
      all.textContent = open ? "collapse all probes" : "expand all probes";
    });
    // A matrix cell shows its own records: every group opened, other cells' rows hidden.
    Array.prototype.forEach.call(document.querySelectorAll("#matrix a[data-cell]"), function (a) {
      a.addEventListener("click", function () {
        cell = a.getAttribute("data-cell");
        select.value = "";  // every record of the cell, passing ones too
        document.getElementById("cell-filter-name").textContent = a.getAttribute("title");
        Array.prototype.forEach.call(table.tBodies, function (tb) { setGroup(tb, true); });
        applyFilter();
      });
    });
    document.getElementById("cell-filter-clear").addEventListener("click", function () {
      cell = "";
      applyFilter();
    });
    applyFilter();
  }
})();
