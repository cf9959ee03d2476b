// MathJax 3, served locally. Notebook pages (mkdocs-jupyter) carry raw $...$ in their
// markdown cells, so the processing classes include the notebook containers as well as
// arithmatex's spans; every page change re-typesets (material's instant loading fires document$).
window.MathJax = {
  tex: {
    inlineMath: [["$", "$"], ["\\(", "\\)"]],
    displayMath: [["$$", "$$"], ["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: "tex2jax_ignore|mathjax_ignore",
    processHtmlClass: "tex2jax_process|mathjax_process|arithmatex|jp-RenderedMarkdown|jp-MarkdownOutput",
  },
  startup: {
    typeset: true,
  },
};

if (typeof document$ !== "undefined") {
  document$.subscribe(function () {
    if (window.MathJax && MathJax.typesetPromise) {
      MathJax.typesetClear && MathJax.typesetClear();
      MathJax.typesetPromise();
    }
  });
}
