"""text_similarity metrics, each a score in [0, 1].

    fuzzy_match   rapidfuzz `fuzz.ratio` / 100 (normalized Indel similarity)
    bleu          sacrebleu sentence BLEU (default smoothing: exp) / 100
    gleu          Google-BLEU (Wu et al. 2016, as nltk's sentence_gleu): min(n-gram precision, recall), n=1..4
    rouge_N/L     rouge-score F-measure of ROUGE-N / ROUGE-L (no stemming; ROUGE-L's LCS by rapidfuzz)
    meteor        unsupported: nltk's METEOR downloads WordNet at run time
    cosine        unsupported: it needs an embedding model

    >>> gleu("the cat sat", "the cat sat")
    1.0
    >>> round(gleu("the cat", "the cat sat"), 4)  # 1-grams 2/3, 2-grams 1/2: min over the total = 3/6
    0.5
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Any

from ._deps import require
from ._errors import UnsupportedMetricError

UNSUPPORTED = {
    "meteor": "meteor is not supported: nltk's METEOR needs the WordNet corpus downloaded at run time",
    "cosine": "cosine is not supported: it needs an embedding model (use a score_model grader instead)",
}


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def gleu(input: str, reference: str, max_n: int = 4) -> float:
    """Whitespace tokens; n-gram matches over all n in 1..max_n divided by max(hypothesis, reference) n-grams."""
    hyp, ref = input.split(), reference.split()
    matches = hyp_total = ref_total = 0
    for n in range(1, max_n + 1):
        h, r = _ngrams(hyp, n), _ngrams(ref, n)
        matches += sum((h & r).values())
        hyp_total += sum(h.values())
        ref_total += sum(r.values())
    denominator = max(hyp_total, ref_total)
    return matches / denominator if denominator else 0.0


def bleu(input: str, reference: str) -> float:
    sacrebleu = require("sacrebleu", "sacrebleu", "the bleu metric")
    return float(sacrebleu.sentence_bleu(input, [reference]).score) / 100.0


def fuzzy_match(input: str, reference: str) -> float:
    fuzz = require("rapidfuzz.fuzz", "rapidfuzz", "the fuzzy_match metric")
    return float(fuzz.ratio(input, reference)) / 100.0


@lru_cache(maxsize=8)
def _rouge_scorer(rouge_type: str) -> Any:
    rouge = require("rouge_score.rouge_scorer", "rouge-score", "the rouge metrics")
    return rouge.RougeScorer([rouge_type], use_stemmer=False)


@lru_cache(maxsize=1)
def _rouge_tokenizer() -> Any:
    tokenizers = require("rouge_score.tokenizers", "rouge-score", "the rouge metrics")
    return tokenizers.DefaultTokenizer(use_stemmer=False)


def rouge_l(input: str, reference: str) -> float:
    """rouge-score's ROUGE-L F-measure (its tokens, its formula), with the longest common subsequence from
    rapidfuzz's bit-parallel C code: rouge-score fills an n×m table in Python (seconds and gigabytes for
    texts of a few thousand words)."""
    lcs_seq = require("rapidfuzz.distance.LCSseq", "rapidfuzz", "the rouge_l metric")
    tokenizer = _rouge_tokenizer()
    hyp, ref = tokenizer.tokenize(input), tokenizer.tokenize(reference)
    if not hyp or not ref:
        return 0.0
    lcs = lcs_seq.similarity(ref, hyp)
    precision, recall = lcs / len(hyp), lcs / len(ref)
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge(input: str, reference: str, metric: str) -> float:
    """`metric` is rouge_1 .. rouge_5 or rouge_l."""
    if metric == "rouge_l":
        return rouge_l(input, reference)
    rouge_type = "rouge" + metric.removeprefix("rouge_")
    return float(_rouge_scorer(rouge_type).score(reference, input)[rouge_type].fmeasure)


def similarity(input: str, reference: str, metric: str) -> float:
    """The metric's score, clamped to [0, 1] (sacrebleu gives 100.00000000000004 for identical texts)."""
    return min(max(_similarity(input, reference, metric), 0.0), 1.0)


_METRICS = frozenset({"fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"})


def check_metric(metric: str) -> None:
    """Raise UnsupportedMetricError unless `similarity` can compute `metric` (before any text is sent off)."""
    if metric in UNSUPPORTED:
        raise UnsupportedMetricError(UNSUPPORTED[metric])
    if metric not in _METRICS:
        raise UnsupportedMetricError(f"unknown evaluation_metric {metric!r}")


def _similarity(input: str, reference: str, metric: str) -> float:
    check_metric(metric)
    if metric == "fuzzy_match":
        return fuzzy_match(input, reference)
    if metric == "bleu":
        return bleu(input, reference)
    if metric == "gleu":
        return gleu(input, reference)
    if metric.startswith("rouge_"):
        return rouge(input, reference, metric)
    raise UnsupportedMetricError(f"unknown evaluation_metric {metric!r}")
