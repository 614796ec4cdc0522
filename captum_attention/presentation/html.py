"""A self-contained HTML report: no scripts, no external resources, every token escaped."""

from __future__ import annotations

from html import escape

from .explain import Explanations

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
section { margin-bottom: 2.5em; }
table { border-collapse: collapse; }
th, td { text-align: left; padding: 0.3em 0.6em; border-bottom: 1px solid #ddd; vertical-align: top; }
td.time { text-align: right; white-space: nowrap; color: #555; }
.tok { display: inline-block; padding: 0.1em 0.25em; margin: 0.1em; border-radius: 0.2em;
       font-family: ui-monospace, monospace; }
.legend .tok { margin-right: 1em; }
"""


def _colour(score: float, scale: float) -> str:
    strength = 0.0 if scale == 0 else min(abs(score) / scale, 1.0)
    rgb = "0, 140, 60" if score >= 0 else "210, 40, 40"
    return f"rgba({rgb}, {strength:.3f})"


def _token_row(tokens: list[str], scores: list[float], special: list[bool]) -> str:
    # Rollout and relevance put most mass on [CLS] itself: scale by the words' scores.
    words = [abs(s) for s, is_special in zip(scores, special) if not is_special]
    scale = max(words or [abs(s) for s in scores] or [0.0])
    return " ".join(
        f'<span class="tok" style="background: {_colour(score, scale)}" '
        f'title="{escape(f"{score:.4e}")}">{escape(token)}</span>'
        for token, score in zip(tokens, scores)
    )


def render_html(explanations: Explanations, model_name: str) -> str:
    """The report page: per sentence the prediction and a coloured token row per method."""
    count = len(explanations.sentences)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>captum-attention report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>captum-attention report</h1>",
        f"<p>Model: <code>{escape(model_name)}</code>. Wall times are for the whole batch of "
        f"{count} sentence{'s' if count != 1 else ''}.</p>",
        '<p class="legend"><span class="tok" style="background: rgba(0, 140, 60, 0.8)">supports</span>'
        '<span class="tok" style="background: rgba(210, 40, 40, 0.8)">opposes</span>'
        "the explained class; colour strength is relative to the largest score of the row's "
        "non-special tokens (hover a token for its score).</p>",
    ]
    for sentence in explanations.sentences:
        parts.append("<section>")
        parts.append(f"<h2>{escape(sentence.text)}</h2>")
        parts.append(
            f"<p>Prediction: <b>{escape(sentence.label)}</b> (p = {sentence.probability:.3f}); "
            f"explaining <b>{escape(sentence.target_label)}</b>.</p>"
        )
        parts.append("<table><tr><th>method</th><th>wall time</th><th>tokens</th></tr>")
        for method, seconds in explanations.seconds.items():
            parts.append(
                f"<tr><td>{escape(method)}</td><td class=\"time\">{seconds * 1000:.0f} ms</td>"
                f"<td>{_token_row(sentence.tokens, sentence.scores[method], sentence.special)}</td></tr>"
            )
        parts.append("</table></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
