"""SmolLM2 on your code: which pieces of a generation are the learner's, and whether greedy
decoding on them gives the package's tokens."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minillm.course.exercises_backend import exercises_backend
from minillm.course.seats import ENGINE, KERNEL, SEATS, SINGLE, learner_seats, tasks_up_to, written
from minillm.generation.generate import Generation
from minillm.generation.sampling import SamplingParams
from minillm.llm import LLM, load_tokenizer
from minillm.model.fetch import cached_model_path, fetch
from minillm.model.loader import load_model


@dataclass(repr=False)
class YourCodeResult:
    pieces: list[tuple[str, str, str]]  # (task, whose, where) per task up to the chapter
    package_tokens: list[int]
    your_tokens: list[int]

    @property
    def equal(self) -> bool:
        return self.package_tokens == self.your_tokens

    @property
    def yours(self) -> list[str]:
        return [task for task, whose, _ in self.pieces if whose.startswith("yours")]

    def __repr__(self) -> str:  # one line: a notebook cell ending with your_code(...) echoes it
        tokens = f"the package's {len(self.package_tokens)} tokens" if self.equal else "not the package's tokens"
        return f"YourCodeResult({len(self.yours)} of {len(self.pieces)} pieces yours: {tokens})"


def your_code(chapter: str = "ch02", prompt: str = "The capital of France is", max_tokens: int = 12,
              model: str | Path | None = None) -> YourCodeResult:
    """Greedy tokens of SmolLM2 on the learner's pieces of chapters up to `chapter` beside the
    package's. Chapters before 07 generate one request on a contiguous cache (chapter 06's
    Generation); from 07 on, through the paged engine (LLMEngine), where the paged pieces sit."""
    path = Path(model) if model is not None else (cached_model_path() or fetch())
    on_path = ENGINE if chapter >= "ch07" else SINGLE
    kernels = exercises_backend().tasks
    pieces = [(task, *_whose(task, on_path, kernels)) for task in tasks_up_to(chapter)]
    print(f"SmolLM2 on your code, chapters 01-{chapter[2:]}, "
          f"{'the paged engine' if on_path == ENGINE else 'one request on a contiguous KV cache'}:")
    width = max(len(t) for t, _, _ in pieces)
    for task, whose, where in pieces:
        print(f"  {task:<{width}}  {whose:<55}  {where}")
    if not any(whose.startswith("yours") for _, whose, _ in pieces):
        print("Nothing is yours yet: every piece is the package's, so both runs below are the package's.")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    package_tokens = _greedy(path, "numba", prompt, params, on_path)
    with learner_seats(chapter):
        your_tokens = _greedy(path, "exercises", prompt, params, on_path)
    result = YourCodeResult(pieces, package_tokens, your_tokens)
    _print_tokens(path, prompt, result)
    return result


def _whose(task: str, on_path: str, kernels: dict[str, str]) -> tuple[str, str]:
    seat = SEATS[task]
    if seat.path is None:
        return "package (no seat)", seat.note
    if seat.path not in (on_path, "both"):
        reached = "the paged engine" if seat.path == ENGINE else "the contiguous-cache path (chapters 02-06)"
        return "not used here", f"runs only on {reached}"
    if seat.note.startswith(KERNEL):
        return kernels[task], seat.note
    whose = "yours" if written(task) else "package (not written yet)"
    where = ", ".join(f"{m}.{a}" for m, a in seat.targets)
    return whose, where + (f" - {seat.note}" if seat.note else "")


def _greedy(path: Path, backend: str, prompt: str, params: SamplingParams, on_path: str) -> list[int]:
    if on_path == ENGINE:
        return LLM(path, backend=backend).generate([prompt], params)[0].token_ids
    tokenizer = load_tokenizer(path)
    model = load_model(path, backend=backend)
    return Generation(model, tokenizer, tokenizer.encode(prompt), params).run().token_ids


def _print_tokens(path: Path, prompt: str, result: YourCodeResult) -> None:
    tokenizer = load_tokenizer(path)
    print(f"\nprompt: {prompt!r}")
    print(f"  {'#':>3}  {'package':<22}{'yours':<22}")
    for i in range(max(len(result.package_tokens), len(result.your_tokens))):
        theirs = result.package_tokens[i] if i < len(result.package_tokens) else None
        mine = result.your_tokens[i] if i < len(result.your_tokens) else None
        cell = lambda t: "-" if t is None else f"{t} {tokenizer.decode([t])!r}"  # noqa: E731
        print(f"  {i:>3}  {cell(theirs):<22}{cell(mine):<22}{'' if theirs == mine else '<- differs'}")
    print("the same tokens" if result.equal else "the tokens differ: check() the pieces marked yours")
