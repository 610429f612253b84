"""A generation profile drawn: prefill and decode, eager against fused, as one HTML table
(time and launches per token, the speedup, each module kind's gain)."""

from __future__ import annotations

import html

from te_lab.profiler.generation import MODES, PHASES, GenerationProfile


def generation_html(profile: GenerationProfile) -> str:
    """The table ``te_lab.show`` displays for a :class:`GenerationProfile`."""
    rows = []
    for phase in PHASES:
        figures = profile.phases[phase]
        gains = ", ".join(f"{html.escape(kind)} {gain:.2f}x"
                          for kind, gain in sorted(profile.module_gains(phase).items()))
        cells = [phase, str(figures["fused"].tokens), str(figures["fused"].forwards)]
        cells += [f"{figures[mode].ms_per_token:.3f}" for mode in MODES]
        cells += [f"{profile.speedup(phase):.2f}x"]
        cells += [f"{figures[mode].launches_per_token:.1f}" for mode in MODES]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + f"<td>{gains or '-'}</td></tr>")
    header = ("<tr><th>phase</th><th>tokens</th><th>forwards</th><th>eager ms/token</th><th>fused ms/token</th>"
              "<th>speedup</th><th>eager launches/token</th><th>fused launches/token</th><th>module gains</th></tr>")
    return (f"<table class='te-lab-generation'><caption>generation, eager against fused "
            f"({profile.runs} runs per mode, interleaved)</caption>{header}{''.join(rows)}</table>")


def show_generation(profile: GenerationProfile) -> None:
    """The table in a notebook; the text summary elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        print(profile.summary())
        return
    if get_ipython() is None:
        print(profile.summary())
        return
    display(HTML(generation_html(profile)))
