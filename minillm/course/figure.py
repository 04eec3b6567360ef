"""Chapter 00's map: the six layers of minillm and one request's path through them."""
from __future__ import annotations

# bottom to top: (layer, sub-package, the chapters that build it)
LAYERS = (
    ("1 hardware", "minillm/hardware", "ch 01"),
    ("2 operators", "minillm/kernels", "ch 02-04"),
    ("3 model", "minillm/model", "ch 04-05"),
    ("4 generation", "minillm/generation", "ch 06, 10-11"),
    ("5 runtime", "minillm/runtime", "ch 07-08, 10, 12"),
    ("6 serving", "minillm/serve", "ch 09, 11-12"),
)
# one request, in order: (step, the layer it happens in (index into LAYERS), the chapter that builds it)
REQUEST_PATH = (
    ("text in\n(HTTP request)", 5, "ch 09"),
    ("tokenizer\n(BPE)", 3, "ch 06"),
    ("scheduler +\nblock manager", 4, "ch 07-08"),
    ("forward\n(30 layers)", 2, "ch 05"),
    ("kernels\n(qlinear, attention)", 1, "ch 02-04"),
    ("sampler", 3, "ch 06, 08"),
    ("detokenizer", 3, "ch 06"),
    ("SSE chunk\nout", 5, "ch 09"),
)


def draw_stack() -> None:
    """Show the stack (see stack_figure) and return None: a returned figure would be drawn twice in
    a notebook, once by the inline backend at the cell's end and once more as the cell's value."""
    import matplotlib.pyplot as plt

    stack_figure()
    plt.show()  # the inline backend displays the figure here and closes it


def stack_figure():
    """The stack (matplotlib; no image file): the six layers as bands, bottom to top, and a
    request's path through them as numbered steps, each labelled with the chapter that builds it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(13, 6.5))
    label_width, step_width = 3.2, 1.45
    right = label_width + step_width * len(REQUEST_PATH) + 0.2
    for y, (layer, package, chapters) in enumerate(LAYERS):
        ax.add_patch(FancyBboxPatch((0, y + 0.06), right, 0.88, boxstyle="round,pad=0.02",
                                    facecolor=plt.cm.Blues(0.08 + 0.06 * y), edgecolor="none"))
        ax.text(0.15, y + 0.62, layer, fontsize=12, weight="bold", va="center")
        ax.text(0.15, y + 0.3, f"{package} · {chapters}", fontsize=9, va="center", color="0.25")
    points = []
    for i, (step, layer, chapter) in enumerate(REQUEST_PATH):
        x, y = label_width + step_width * (i + 0.5), layer + 0.5
        ax.text(x, y, f"{i + 1}. {step}\n{chapter}", ha="center", va="center", fontsize=8.5,
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "tab:orange"})
        points.append((x, y))
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        ax.annotate("", xy=(x1 - 0.5, y1), xytext=(x0 + 0.5, y0),
                    arrowprops={"arrowstyle": "->", "color": "tab:orange", "lw": 1.6})
    ax.text(right / 2, len(LAYERS) + 0.15, "minillm: six layers, and one request's path through them "
            "(each layer imports only the layers below it)", ha="center", fontsize=12)
    ax.set_xlim(0, right)
    ax.set_ylim(0, len(LAYERS) + 0.4)
    ax.axis("off")
    fig.tight_layout()
    return fig
