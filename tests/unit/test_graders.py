"""artlike.graders: worked examples for every grader, templates, the safe formula evaluator, weight rules,
and the OpenAI API spec's own grader examples."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from artlike.graders import (
    FormulaError,
    GradeResult,
    GraderNotRunnableHere,
    MissingDependencyError,
    MultiGrader,
    PythonGrader,
    RewardComponents,
    ScoreModelGrader,
    StringCheckGrader,
    TemplateError,
    TextSimilarityGrader,
    UnsupportedMetricError,
    compile_formula,
    grade,
    grade_async,
    parse_grader,
    render,
)
from artlike.graders._format import format_reward
from artlike.graders._math_accuracy import final_answer

# ------------------------------------------------------------------------------------------- templates


def test_render_substitutes_item_and_sample_paths() -> None:
    sample = {"output_text": "4", "output_json": {"x": {"y": [10, 20]}}}
    item = {"q": "2+2", "a": {"b": "deep"}, "n": 3, "obj": {"k": 1}}
    assert render("{{item.q}}={{ sample.output_text }}", sample, item) == "2+2=4"
    assert render("{{item.a.b}} {{sample.output_json.x.y[1]}} {{sample.output_json.x.y.0}}", sample, item) \
        == "deep 20 10"
    # non-strings are written as JSON
    assert render("{{item.n}} {{item.obj}}", sample, item) == '3 {"k": 1}'


def test_render_never_renders_a_substituted_value_again() -> None:
    assert render("{{sample.output_text}}", {"output_text": "{{item.secret}}"}, {"secret": "s3"}) \
        == "{{item.secret}}"


@pytest.mark.parametrize(("template", "path", "kind"), [
    ("{{item.missing}}", "item.missing", "invalid_variable_error"),
    ("{{item.a.c}}", "item.a.c", "invalid_variable_error"),
    ("{{item.xs[5]}}", "item.xs[5]", "invalid_variable_error"),
    ("{{os.environ}}", "os.environ", "invalid_variable_error"),
    ("{{item}}", "item", "invalid_variable_error"),
    ("{{sample.output_json.x}}", "sample.output_json.x", "sample_parse_error"),
])
def test_render_names_the_missing_key(template: str, path: str, kind: str) -> None:
    with pytest.raises(TemplateError) as e:
        render(template, {"output_text": "not json"}, {"a": {"b": 1}, "xs": [1]})
    assert e.value.path == path
    assert e.value.kind == kind
    assert "{{" + path + "}}" in str(e.value)


def test_grade_reports_a_template_error_as_a_zero_score_with_the_error() -> None:
    g = {"type": "string_check", "name": "s", "input": "{{sample.output_text}}", "reference": "{{item.label}}",
         "operation": "eq"}
    result = grade(g, "Paris", {"answer": "Paris"})
    assert result.score == 0.0
    assert result.error is not None
    assert result.error.kind == "invalid_variable_error"
    assert "item.label" in result.error.message


def test_a_json_output_fills_output_json() -> None:
    g = {"type": "string_check", "name": "s", "input": "{{sample.output_json.city}}", "reference": "Paris",
         "operation": "eq"}
    assert grade(g, '{"city": "Paris"}').score == 1.0
    # a sample given as a dict gets output_json from its output_text too
    assert grade(g, {"output_text": '{"city": "Rome"}'}).score == 0.0
    # and a chat-completion-shaped sample gives output_text from its first choice
    assert grade(g, {"choices": [{"message": {"content": '{"city": "Paris"}'}}]}).score == 1.0


# ---------------------------------------------------------------------------------------- string_check


@pytest.mark.parametrize(("operation", "output", "reference", "score"), [
    ("eq", "Paris", "Paris", 1.0),
    ("eq", "Paris", "paris", 0.0),
    ("ne", "Paris", "paris", 1.0),
    ("ne", "Paris", "Paris", 0.0),
    ("like", "The capital is Paris.", "Paris", 1.0),
    ("like", "The capital is paris.", "Paris", 0.0),
    ("ilike", "The capital is PARIS.", "paris", 1.0),
    ("ilike", "Rome", "paris", 0.0),
    # SeekrFlow's names
    ("equals", "28", "28", 1.0),
    ("not_equals", "28", "28", 0.0),
    ("contains", "x = 28", "28", 1.0),
    ("case_insensitive_contains", "ANSWER: Yes", "yes", 1.0),
])
def test_string_check(operation: str, output: str, reference: str, score: float) -> None:
    g = {"type": "string_check", "operation": operation}  # defaults: output vs item.reference_answer
    result = grade(g, output, {"reference_answer": reference})
    assert (result.score, result.error) == (score, None)


def test_string_check_maps_seekrflow_names_and_rejects_unknown_operations() -> None:
    assert StringCheckGrader.model_validate({"operation": "CONTAINS"}).operation == "like"
    with pytest.raises(ValidationError):
        StringCheckGrader.model_validate({"operation": "startswith"})


# ------------------------------------------------------------------------------------- text_similarity

OUT = "the quick brown fox jumps over the dog"
REF = "the quick brown fox jumped over the lazy dog"


def _similarity(metric: str, output: str = OUT, reference: str = REF, **extra: Any) -> GradeResult:
    g = {"type": "text_similarity", "name": "t", "input": "{{sample.output_text}}", "reference": "{{item.ref}}",
         "evaluation_metric": metric, **extra}
    return grade(g, output, {"ref": reference})


def test_fuzzy_match_is_the_normalized_indel_similarity() -> None:
    # abcd -> abce: 2 edits (delete d, insert e) over 8 characters: 1 - 2/8
    assert _similarity("fuzzy_match", "abcd", "abce").score == pytest.approx(0.75)


def test_bleu_is_sacrebleus_sentence_bleu_over_100() -> None:
    sacrebleu = pytest.importorskip("sacrebleu")
    expected = sacrebleu.sentence_bleu(OUT, [REF]).score / 100
    assert _similarity("bleu").score == pytest.approx(expected)
    assert _similarity("bleu").score == pytest.approx(0.377079, abs=1e-6)
    assert _similarity("bleu", REF, REF).score == 1.0  # clamped: sacrebleu says 100.00000000000004
    assert _similarity("bleu", "", REF).score == 0.0


def test_rouge_scores_are_f_measures() -> None:
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    # ROUGE-2: 4 shared bigrams of 7 (output) and 8 (reference): F = 2*4/(7+8)
    assert _similarity("rouge_2").score == pytest.approx(8 / 15)
    # ROUGE-L: the longest common subsequence has 7 of 8 and 9 tokens: F = 2*7/(8+9)
    assert _similarity("rouge_l").score == pytest.approx(14 / 17)
    library = rouge_scorer.RougeScorer(["rouge1", "rouge3"]).score(REF, OUT)
    assert _similarity("rouge_1").score == pytest.approx(library["rouge1"].fmeasure)
    assert _similarity("rouge_3").score == pytest.approx(library["rouge3"].fmeasure)
    assert _similarity("rouge_5", "a b c", "a b c d").score == 0.0  # no 5-grams at all
    assert _similarity("rouge_1", "", REF).score == 0.0


def test_gleu_is_min_of_ngram_precision_and_recall() -> None:
    # n = 1..4: 7 + 4 + 2 + 1 = 14 matches; max(26 output, 30 reference) n-grams
    assert _similarity("gleu").score == pytest.approx(14 / 30)
    gleu_score = pytest.importorskip("nltk.translate.gleu_score")
    assert _similarity("gleu").score == pytest.approx(gleu_score.sentence_gleu([REF.split()], OUT.split()))
    assert _similarity("gleu", "", "").score == 0.0


@pytest.mark.parametrize("metric", ["meteor", "cosine"])
def test_metrics_needing_downloads_or_embeddings_are_refused(metric: str) -> None:
    with pytest.raises(UnsupportedMetricError, match=metric):
        _similarity(metric)


def test_pass_threshold_sets_passed_and_leaves_the_score() -> None:
    assert _similarity("rouge_l", pass_threshold=0.8).passed is True
    result = _similarity("rouge_l", pass_threshold=0.9)
    assert (result.passed, result.score) == (False, pytest.approx(14 / 17))
    assert _similarity("rouge_l").passed is None


def test_seekrflow_text_similarity_operation_names_the_metric() -> None:
    assert TextSimilarityGrader.model_validate({"operation": "rouge"}).evaluation_metric == "rouge_l"
    assert TextSimilarityGrader.model_validate({"operation": "BLEU"}).evaluation_metric == "bleu"


def test_a_missing_metric_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # makes `import sacrebleu` fail
    with pytest.raises(MissingDependencyError, match=r"artlike\[graders\]"):
        _similarity("bleu")


def test_the_library_imports_without_its_metric_packages() -> None:
    heavy = ["sacrebleu", "rouge_score", "rapidfuzz", "math_verify", "nltk", "sympy", "torch"]
    code = (f"import sys\nfor m in {heavy!r}: sys.modules[m] = None\n"
            "import artlike.graders as g\n"
            "print(g.grade({'type': 'string_check', 'operation': 'eq'}, '1', {'reference_answer': '1'}).score)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": ":".join(sys.path)})
    assert (out.returncode, out.stdout.strip()) == (0, "1.0"), out.stderr


# -------------------------------------------------------------------------------------- math_accuracy


@pytest.mark.parametrize(("output", "reference", "score"), [
    ("<think>lcm(4, 14)</think><answer>28</answer>", "28", 1.0),
    ("<think>...</think><answer>27</answer>", "28", 0.0),
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    ("<answer>0.75</answer>", r"\frac{3}{4}", 1.0),
    ("<answer>3/4</answer>", "0.75", 1.0),
    ("It costs 12 dollars, so 12 + 16 = 28.", "28", 1.0),  # the last number
    ("Total: 1,000", "1000", 1.0),
    ("<answer>12 cm</answer>", "12", 1.0),
    ("I do not know.", "28", 0.0),  # nothing to parse: 0, not an error
    ("<answer>banana</answer>", "28", 0.0),
])
def test_math_accuracy(output: str, reference: str, score: float) -> None:
    result = grade({"type": "math_accuracy"}, output, {"reference_answer": reference})
    assert (result.score, result.error) == (score, None)


def test_math_accuracy_reports_the_answer_it_graded() -> None:
    result = grade({"type": "math_accuracy"}, r"<answer>x</answer> and \boxed{7}", {"reference_answer": "7"})
    assert result.metadata["answer"] == "7"  # boxed wins over answer tags
    assert final_answer("1, 2, then -3.5") == "-3.5"
    assert final_answer(r"\boxed{unclosed") is None


def test_math_accuracy_lets_a_programming_error_surface(monkeypatch: pytest.MonkeyPatch) -> None:
    math_verify = pytest.importorskip("math_verify")

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise TypeError("bug")

    monkeypatch.setattr(math_verify, "verify", broken)
    with pytest.raises(TypeError, match="bug"):
        grade({"type": "math_accuracy"}, "28", {"reference_answer": "28"})


# --------------------------------------------------------------------------------------------- format


@pytest.mark.parametrize(("output", "score", "answer"), [
    ("<think>4 and 14</think><answer>28</answer>", 1.0, "28"),
    ("  <think>\nmulti\nline\n</think>\n<answer> 28 </answer>\n", 1.0, "28"),
    ("<answer>28</answer>", 0.0, "28"),  # no think: wrong format, answer still found
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0, "2"),
    ("<think>a</think><answer>1</answer> trailing words", 0.0, "1"),
    ("28", 0.0, None),
])
def test_format_reward(output: str, score: float, answer: str | None) -> None:
    assert format_reward(output) == (score, answer)
    result = grade({"type": "format"}, output)
    assert (result.score, result.metadata["answer"]) == (score, answer)


# ---------------------------------------------------------------------------------- RewardComponents

GOOD = "<think>lcm</think><answer>28</answer>"


def test_reward_components_default_weights_and_score() -> None:
    rc = RewardComponents.model_validate({"graders": [
        {"type": "math_accuracy"}, {"type": "string_check", "operation": "equals"}]})
    assert rc.resolved_weights() == (0.1, [0.45, 0.45])
    # format 1, math 1 on the extracted answer, string_check equals "28" on the extracted answer too
    result = grade(rc, GOOD, {"reference_answer": "28"})
    assert result.score == pytest.approx(1.0)
    assert result.sub_scores == {"format": 1.0, "math_accuracy": 1.0, "string_check": 1.0}
    assert result.metadata["answer"] == "28"
    # bad format: 0.1 * 0 + 0.45 * 1 (math finds the last number) + 0.45 * 0 (not equal to "28")
    assert grade(rc, "It is 28.", {"reference_answer": "28"}).score == pytest.approx(0.45)


def test_reward_components_can_grade_the_whole_output() -> None:
    rc = RewardComponents.model_validate({"extract_answer": False, "graders": [
        {"type": "string_check", "operation": "equals"}]})
    assert grade(rc, GOOD, {"reference_answer": "28"}).score == pytest.approx(0.1)


def test_reward_components_seekrflow_examples() -> None:
    weighted = parse_grader({"graders": [
        {"type": "math_accuracy", "weight": 0.4},
        {"type": "string_check", "weight": 0.3, "operation": "equals"},
        {"type": "text_similarity", "weight": 0.3, "operation": "rouge"}]})
    assert isinstance(weighted, RewardComponents)
    assert weighted.resolved_weights() == (0.1, pytest.approx([0.36, 0.27, 0.27]))
    explicit = parse_grader({"format_reward_weight": 0.2, "graders": [
        {"type": "math_accuracy", "weight": 0.3},
        {"type": "text_similarity", "weight": 0.5, "operation": "bleu"}]})
    assert isinstance(explicit, RewardComponents)
    assert explicit.resolved_weights() == (0.2, [0.3, 0.5])
    # format 1, math 1, bleu of "28" against "28" = 1
    result = grade(explicit, GOOD, {"reference_answer": "28"})
    assert result.score == pytest.approx(1.0)
    assert grade(explicit, "<answer>27</answer>", {"reference_answer": "28"}).score == pytest.approx(0.0)
    # explicit format weight, unweighted graders: they share the rest equally
    shared = RewardComponents.model_validate({"format_reward_weight": 0.4, "graders": [
        {"type": "math_accuracy"}, {"type": "format"}]})
    assert shared.resolved_weights() == (0.4, [0.3, 0.3])


@pytest.mark.parametrize(("config", "message"), [
    ({"graders": [{"type": "math_accuracy", "weight": 0.5}, {"type": "format"}]}, "every grader a weight or none"),
    ({"graders": [{"type": "math_accuracy", "weight": 0.5}, {"type": "format", "weight": 0.4}]},
     "grader weights must sum to 1.0, not 0.9"),
    ({"format_reward_weight": 0.1, "graders": [{"type": "math_accuracy", "weight": 1.0}]},
     "format_reward_weight + grader weights must sum to 1.0, not 1.1"),
    ({"format_reward_weight": 0.2, "graders": [{"type": "math_accuracy", "weight": 0.3},
                                               {"type": "format", "weight": 0.3}]},
     "format_reward_weight + grader weights must sum to 1.0, not 0.8"),
])
def test_weight_rule_errors_name_the_weights(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        RewardComponents.model_validate(config)
    (error,) = e.value.errors()
    assert error["type"] == "grader_weights"
    assert message in error["msg"]
    assert str([g.get("weight") for g in config["graders"]]) in error["msg"]


def test_weights_out_of_range_are_refused() -> None:
    with pytest.raises(ValidationError):
        RewardComponents.model_validate({"graders": [{"type": "format", "weight": 1.5}]})
    with pytest.raises(ValidationError):
        RewardComponents.model_validate({"format_reward_weight": -0.1, "graders": [{"type": "format"}]})


# ------------------------------------------------------------------------------ multi, calculate_output


def _multi(formula: str, **graders: dict[str, Any]) -> dict[str, Any]:
    return {"type": "multi", "name": "m", "graders": graders, "calculate_output": formula}


EQ = {"type": "string_check", "name": "eq", "input": "{{sample.output_text}}", "reference": "{{item.label}}",
      "operation": "eq"}
LIKE = {"type": "string_check", "name": "like", "input": "{{sample.output_text}}", "reference": "{{item.label}}",
        "operation": "ilike"}


@pytest.mark.parametrize(("formula", "score"), [
    ("0.5 * exact + 0.5 * loose", 0.5),
    ("(exact + loose) / 2", 0.5),
    ("max(exact, loose)", 1.0),
    ("min(exact, loose, 0.3)", 0.0),
    ("loose ^ 2 - exact", 1.0),
    ("-exact + abs(-0.25) * 2 ** 2", 1.0),
    ("sqrt(0.25) + floor(0.9) + ceil(0.1) - exp(0) + log(1)", 0.5),
])
def test_multi_grader_combines_sub_scores(formula: str, score: float) -> None:
    result = grade(_multi(formula, exact=EQ, loose=LIKE), "PARIS!", {"label": "paris"})
    assert result.error is None
    assert result.sub_scores == {"exact": 0.0, "loose": 1.0}
    assert result.score == pytest.approx(score)


def test_multi_grader_reports_formula_and_sub_grader_errors() -> None:
    bad = grade(_multi("exact +", exact=EQ), "x", {"label": "x"})
    assert bad.error is not None and bad.error.kind == "formula_parse_error"
    unknown = grade(_multi("exact + nope", exact=EQ), "x", {"label": "x"})
    assert unknown.error is not None and "nope" in unknown.error.message
    zero = grade(_multi("1 / exact", exact=EQ), "x", {"label": "y"})
    assert zero.error is not None and zero.error.kind == "formula_parse_error" and zero.score == 0.0
    missing = grade(_multi("exact", exact=EQ), "x", {})
    assert missing.error is not None and missing.error.kind == "invalid_variable_error"
    assert missing.error.message.startswith("exact: ")


def test_multi_grader_with_a_list_uses_the_graders_names() -> None:
    g = {"type": "multi", "name": "m", "graders": [{**EQ, "name": "exact match"}, LIKE],
         "calculate_output": "exact_match + like"}
    assert grade(g, "paris", {"label": "paris"}).score == 2.0


@pytest.mark.parametrize(("formula", "why"), [
    ("__import__('os')", "'__import__' is not a function"),
    ("__import__('os').system('true')", "\"__import__('os').system\" is not a function"),
    ("exec('1')", "'exec' is not a function"),
    ("a.__class__", "is not allowed (Attribute)"),
    ("max.__self__", "is not allowed (Attribute)"),
    ("().__class__.__bases__", "is not allowed (Attribute)"),
    ("a[0]", "is not allowed (Subscript)"),
    ("'a' * 3", "is not a number"),
    ("True + a", "is not a number"),
    ("1j", "is not a number"),
    ("lambda: 1", "is not allowed (Lambda)"),
    ("a if a else 1", "is not allowed (IfExp)"),
    ("[a]", "is not allowed (List)"),
    ("(x := 1)", "is not allowed (NamedExpr)"),
    ("a < 1", "is not allowed (Compare)"),
    ("a % 2", "is not allowed (BinOp)"),
    ("b", "unknown name 'b'"),
    ("sqrt(a, 2)", "wrong arguments to sqrt()"),
    ("max(a)", "wrong arguments to max()"),
    ("max(*a, 1)", "wrong arguments to max()"),
    ("log(a, base=2)", "wrong arguments to log()"),
    ("a; a", "does not parse"),
    ("10 ** 13", None),  # parses; its value is over the limit (next test)
    ("1" * 14, "is over the limit"),
    ("a +" * 400 + "a", "longer than"),
    ("-" * 300 + "a", "more than 200 parts"),
    ("a\0", "does not parse"),
])
def test_formula_refuses_everything_but_arithmetic(formula: str, why: str | None) -> None:
    if why is None:
        compile_formula(formula, {"a"})
        return
    with pytest.raises(FormulaError) as e:
        compile_formula(formula, {"a"})
    assert why in str(e.value)


@pytest.mark.parametrize(("formula", "why"), [
    ("a ** 1000", "exponent 1000 is over the limit"),
    ("9 ** 9 ** 9", "exponent 3.8742e+08 is over the limit"),
    ("a ^ 65", "exponent 65 is over the limit"),
    ("10 ** 13", "gave 1e+13"),
    ("1e6 * 1e6 * 1e6", "gave 1e+18"),
    ("1e12 ** 30", "out of range"),
    ("exp(1000)", "math range error"),
    ("1 / (a - a)", "float division by zero"),
    ("sqrt(-1)", "math domain error"),
    ("(-8) ** (1 / 3)", "is not a real number"),
])
def test_formula_bounds_its_values(formula: str, why: str) -> None:
    f = compile_formula(formula, {"a"})
    with pytest.raises(FormulaError) as e:
        f.evaluate({"a": 2.0})
    assert why in str(e.value)


def test_formula_allows_a_power_at_the_bound() -> None:
    assert compile_formula("a ** 64", {"a"}).evaluate({"a": 0.5}) == 0.5**64


# ---------------------------------------------------------------------------------- python, model graders

PYTHON_SOURCE = '''def grade(sample: dict, item: dict) -> float:
    """
    Returns 1.0 if `output_text` equals `label`, otherwise 0.0.
    """
    output = sample.get("output_text")
    label = item.get("label")
    return 1.0 if output == label else 0.0
'''


def test_python_grader_is_never_run_in_process(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    g = PythonGrader(name="p", source=f"open({str(marker)!r}, 'w').write('x')\n" + PYTHON_SOURCE)
    with pytest.raises(GraderNotRunnableHere, match="sandbox"):
        grade(g, "a", {"label": "a"})
    with pytest.raises(GraderNotRunnableHere):
        grade({"type": "multi", "name": "m", "graders": {"p": g.model_dump()}, "calculate_output": "p"}, "a")
    assert not marker.exists()


SCORE_MODEL = {
    "type": "score_model", "name": "judge", "model": "judge-model", "range": [0, 10], "pass_threshold": 5,
    "input": [
        {"role": "system", "content": "Score from 0 to 10."},
        {"role": "user", "content": [{"type": "input_text",
                                      "text": "Reference: {{item.label}}\nAnswer: {{sample.output_text}}"}]},
    ],
}


@pytest.mark.parametrize(("answer", "score"), [
    ('{"result": 7}', 7.0),
    ('{"score": 2.5, "why": "meh"}', 2.5),
    ("8/10, because it is close", 8.0),
    ("Score: 12", 10.0),  # clamped to range
    ("-3", 0.0),
])
def test_score_model_calls_the_judge_and_parses_its_score(answer: str, score: float) -> None:
    calls: list[tuple[list[dict[str, Any]], str]] = []

    def judge(messages: list[dict[str, Any]], model: str) -> str:
        calls.append((messages, model))
        return answer

    result = grade(SCORE_MODEL, "Paris", {"label": "Paris, France"}, judge=judge)
    assert (result.score, result.passed, result.error) == (score, score >= 5, None)
    (messages, model), = calls
    assert model == "judge-model"
    assert messages[0] == {"role": "system", "content": "Score from 0 to 10."}
    assert messages[1]["content"][0]["text"] == "Reference: Paris, France\nAnswer: Paris"


def test_score_model_without_a_score_is_a_parse_error() -> None:
    result = grade(SCORE_MODEL, "Paris", {"label": "x"}, judge=lambda m, model: "I cannot grade this.")
    assert result.score == 0.0
    assert result.error is not None and result.error.kind == "model_grader_parse_error"


def test_score_model_needs_a_judge_and_an_async_one_needs_grade_async() -> None:
    with pytest.raises(GraderNotRunnableHere, match="judge"):
        grade(SCORE_MODEL, "Paris", {"label": "x"})

    async def judge(messages: list[dict[str, Any]], model: str) -> str:
        await asyncio.sleep(0)
        return '{"result": 6}'

    with pytest.raises(TypeError, match="grade_async"):
        grade(SCORE_MODEL, "Paris", {"label": "x"}, judge=judge)
    multi = {"type": "multi", "name": "m", "graders": {"j": SCORE_MODEL, "e": EQ}, "calculate_output": "j / 10 + e"}
    result = asyncio.run(grade_async(multi, "x", {"label": "x"}, judge=judge))
    assert result.score == pytest.approx(1.6)


def test_score_model_range_must_be_ordered() -> None:
    with pytest.raises(ValidationError, match="low < high"):
        ScoreModelGrader.model_validate({**SCORE_MODEL, "range": [1, 0]})


def test_label_model_passes_on_a_passing_label() -> None:
    g = {"type": "label_model", "name": "l", "model": "m", "labels": ["positive", "neutral", "negative"],
         "passing_labels": ["positive"], "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
    assert grade(g, "great", judge=lambda m, model: '{"result": "positive"}').score == 1.0
    assert grade(g, "meh", judge=lambda m, model: "Neutral.").metadata["label"] == "neutral"
    bad = grade(g, "meh", judge=lambda m, model: "unsure")
    assert bad.error is not None and bad.error.kind == "model_grader_parse_error"
    with pytest.raises(ValidationError, match="not in labels"):
        parse_grader({**g, "passing_labels": ["great"]})


# ------------------------------------------------------------------------------- the OpenAI spec examples

# Verbatim from openai-openapi.yaml's x-oaiMeta examples (the JSON ones).
SPEC_JSON_EXAMPLES = [
    """{
  "type": "string_check",
  "name": "Example string check grader",
  "input": "{{sample.output_text}}",
  "reference": "{{item.label}}",
  "operation": "eq"
}""",
    """{
  "type": "text_similarity",
  "name": "Example text similarity grader",
  "input": "{{sample.output_text}}",
  "reference": "{{item.label}}",
  "pass_threshold": 0.8,
  "evaluation_metric": "fuzzy_match"
}""",
    """{
  "name": "First label grader",
  "type": "label_model",
  "model": "gpt-4o-2024-08-06",
  "input": [
    {
      "type": "message",
      "role": "system",
      "content": {
        "type": "input_text",
        "text": "Classify the sentiment of the following statement as one of positive, neutral, or negative"
      }
    },
    {
      "type": "message",
      "role": "user",
      "content": {
        "type": "input_text",
        "text": "Statement: {{item.response}}"
      }
    }
  ],
  "passing_labels": [
    "positive"
  ],
  "labels": [
    "positive",
    "neutral",
    "negative"
  ]
}""",
]
SPEC_MULTI_EXAMPLE = """{
  "type": "multi",
  "name": "example multi grader",
  "graders": [
    {
      "type": "text_similarity",
      "name": "example text similarity grader",
      "input": "The graded text",
      "reference": "The reference text",
      "evaluation_metric": "fuzzy_match"
    },
    {
      "type": "string_check",
      "name": "Example string check grader",
      "input": "{{sample.output_text}}",
      "reference": "{{item.label}}",
      "operation": "eq"
    }
  ],
  "calculate_output": "0.5 * text_similarity_score +  0.5 * string_check_score)"
}"""
# The python and score_model examples are Python, not JSON, in the spec: transcribed here.
SPEC_PYTHON_EXAMPLE = {"type": "python", "name": "Example python grader", "image_tag": "2025-05-08",
                       "source": PYTHON_SOURCE, "pass_threshold": 0.8}
SPEC_SCORE_MODEL_EXAMPLE = {
    "type": "score_model",
    "name": "Example score model grader",
    "input": [{"role": "user", "content": [
        {"type": "input_text", "text": (
            "Score how close the reference answer is to the model answer. Score 1.0 if they are the same and 0.0 if they are different."
            " Return just a floating point score\n\n"
            " Reference answer: {{item.label}}\n\n"
            " Model answer: {{sample.output_text}}")},
        {"type": "input_image", "image_url": "https://example.com/reference.png", "file_id": None, "detail": "auto"},
    ]}],
    "model": "gpt-5-mini",
    "sampling_params": {"temperature": 1, "top_p": 1, "seed": 42, "max_completions_tokens": 32768,
                        "reasoning_effort": "medium"},
}


@pytest.mark.parametrize("example", SPEC_JSON_EXAMPLES)
def test_spec_json_examples_parse(example: str) -> None:
    config = json.loads(example)
    g = parse_grader(config)
    assert g.model_dump(exclude_unset=True) == config  # verbatim: nothing dropped or renamed


def test_spec_string_check_and_text_similarity_examples_grade() -> None:
    string_check, text_similarity = (parse_grader(json.loads(e)) for e in SPEC_JSON_EXAMPLES[:2])
    assert grade(string_check, "yes", {"label": "yes"}).score == 1.0
    result = grade(text_similarity, "abcd", {"label": "abce"})
    assert (result.score, result.passed) == (pytest.approx(0.75), False)


def test_spec_multi_example_parses_and_its_unbalanced_formula_is_reported() -> None:
    g = parse_grader(json.loads(SPEC_MULTI_EXAMPLE))
    assert isinstance(g, MultiGrader) and isinstance(g.graders, list)
    result = grade(g, "yes", {"label": "yes"})
    assert result.error is not None and result.error.kind == "formula_parse_error"
    fixed = g.model_copy(update={"calculate_output": "0.5 * example_text_similarity_grader + 0.5 * Example_string_check_grader"})
    assert grade(fixed, "yes", {"label": "yes"}).sub_scores["Example_string_check_grader"] == 1.0


def test_spec_python_and_score_model_examples_parse() -> None:
    python = parse_grader(SPEC_PYTHON_EXAMPLE)
    assert isinstance(python, PythonGrader) and python.pass_threshold == 0.8
    score_model = parse_grader(SPEC_SCORE_MODEL_EXAMPLE)
    assert isinstance(score_model, ScoreModelGrader) and score_model.range == (0.0, 1.0)
    seen: list[list[dict[str, Any]]] = []
    result = grade(score_model, "b", {"label": "a"}, judge=lambda m, model: seen.append(m) or "0.25")
    assert result.score == 0.25
    parts = seen[0][0]["content"]
    assert parts[0]["text"].endswith("Reference answer: a\n\n Model answer: b")
    assert parts[1]["image_url"] == "https://example.com/reference.png"  # non-text parts pass through


def test_unknown_grader_types_and_fields_are_refused() -> None:
    with pytest.raises(ValidationError):
        parse_grader({"type": "regex", "name": "r"})
    with pytest.raises(ValidationError):
        parse_grader({"type": "string_check", "name": "s", "operation": "eq", "opration": "eq"})


@pytest.mark.parametrize("module", ["__init__", "_template", "_string_check", "_text_similarity", "_math_accuracy",
                                    "_format", "_formula", "_model_graders", "_reward"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    name = "artlike.graders" if module == "__init__" else f"artlike.graders.{module}"
    failed, attempted = doctest.testmod(importlib.import_module(name))
    assert (failed, attempted > 0) == (0, True)
