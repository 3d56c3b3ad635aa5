// The live parts of a page: every element with data-live is replaced every 2 s (or every
// data-every milliseconds) by the page's fragment (the same page with ?fragment=1), so what
// changed shows without a reload. Boxes ticked in it stay ticked (an operator choosing jobs
// to cancel while the list refreshes).
(function () {
  const PERIOD_MS = 2000;
  for (const element of document.querySelectorAll("[data-live]")) {
    const url = element.dataset.live;
    const period = Number(element.dataset.every) || PERIOD_MS;
    const refresh = async () => {
      try {
        const response = await fetch(url, { headers: { "Accept": "text/html" } });
        if (response.ok) {
          const ticked = new Set(
            Array.from(element.querySelectorAll("input[type=checkbox]:checked"), (box) => box.value));
          element.innerHTML = await response.text();
          for (const box of element.querySelectorAll("input[type=checkbox]")) {
            box.checked = ticked.has(box.value);
          }
          element.dataset.refreshed = String(Date.now());
        }
      } catch (error) {
        // The dashboard restarting: keep what is shown and try again at the next tick.
      }
      setTimeout(refresh, period);
    };
    setTimeout(refresh, period);
  }
})();
