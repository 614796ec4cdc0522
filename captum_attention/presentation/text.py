"""Terminal output: one table per sentence, tokens down, methods across."""

from __future__ import annotations

from .explain import Explanations


def render_text(explanations: Explanations) -> str:
    """The terminal report: prediction, each token's score per method, wall times."""
    methods = list(explanations.seconds)
    widths = [max(len(name), 11) for name in methods]
    lines = []
    for sentence in explanations.sentences:
        token_width = max(8, *(len(token) for token in sentence.tokens))
        lines.append(sentence.text)
        lines.append(
            f"  prediction: {sentence.label} (p={sentence.probability:.3f}); "
            f"explaining: {sentence.target_label}"
        )
        lines.append("  " + "token".ljust(token_width) + "".join(f"  {m:>{w}}" for m, w in zip(methods, widths)))
        for position, token in enumerate(sentence.tokens):
            cells = "".join(
                f"  {sentence.scores[m][position]:>{w}.4e}" for m, w in zip(methods, widths)
            )
            lines.append("  " + token.ljust(token_width) + cells)
        lines.append("")
    count = len(explanations.sentences)
    times = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in explanations.seconds.items())
    lines.append(f"wall time for {count} sentence{'s' if count != 1 else ''}: {times}")
    return "\n".join(lines)
