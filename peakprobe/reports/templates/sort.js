(function(){
  function key(cell, numeric){
    var raw = cell.hasAttribute('data-v') ? cell.getAttribute('data-v') : cell.textContent;
    if (!numeric) return raw;
    var x = parseFloat(raw);
    return isNaN(x) ? null : x;
  }
  function sortBy(table, col, th){
    var numeric = th.classList.contains('num');
    var now = th.getAttribute('aria-sort');
    var asc = now ? now === 'descending' : !numeric;
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var keyed = rows.map(function(r, i){ return {row: r, k: key(r.cells[col], numeric), i: i}; });
    keyed.sort(function(a, b){
      if (a.k === null || b.k === null) {
        if (a.k === b.k) return a.i - b.i;
        return a.k === null ? 1 : -1;
      }
      var c = numeric ? a.k - b.k : String(a.k).localeCompare(String(b.k));
      if (c === 0) return a.i - b.i;
      return asc ? c : -c;
    });
    var frag = document.createDocumentFragment();
    keyed.forEach(function(e){ frag.appendChild(e.row); });
    body.appendChild(frag);
    Array.prototype.forEach.call(th.parentNode.cells, function(h){ h.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', asc ? 'ascending' : 'descending');
  }
  document.querySelectorAll('table.sortable').forEach(function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function(th, col){
      th.addEventListener('click', function(){ sortBy(table, col, th); });
    });
  });
})();
