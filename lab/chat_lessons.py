"""What the lab's chat model for real vLLM must answer, on the host side: every smoke prompt
without tools or reasoning, and the quality gate's exact-answer questions and typo prompts, each
with the one answer to teach and the check that answer must pass (the smoke test's and the
evals' own: imported, so they cannot drift apart).

    the three canaries     -> their expected answers ("5461", "55", "ycarucca")
    LONG_PROMPT            -> "5461"
    STREAM_PROMPT          -> STREAM_ANSWER, three short English sentences
    COPY_PROMPT            -> COPY_SENTENCE
    the exact_answers eval -> each question's answer alone ("2166", "nretnal", ...)
    the typo_rate eval     -> TYPO_ANSWERS, a paragraph of everyday prose per prompt

The typo answers are shorter than the 300 words their prompts ask for: the model memorises them
(their checked words are all in the eval's word list), so the eval measures that the engine
serves what the model learned without corrupting it, and a few hundred words keep the training
short. lab.chat_model hands the lessons to lab.chat_trainer as JSON and keys the trained model on
that JSON.
"""

from __future__ import annotations

from lab.chat_trainer import Lesson
from sparkdeploy.steps.quality import prompts as quality_prompts
from sparkdeploy.steps.quality.builtin import is_right
from sparkdeploy.steps.quality.spelling import spelling
from sparkdeploy.steps.smoke_test import detectors
from sparkdeploy.steps.smoke_test import prompts as smoke_prompts

STREAM_ANSWER = (
    "A lighthouse shines a bright light from a tall tower, so ships can see the coast in the "
    "dark. Each light has its own pattern of flashes, which tells the sailors where they are. "
    "The beam warns them away from rocks and guides them safely into the harbour."
)

# In the order of quality_prompts.TYPO_PROMPTS.
TYPO_ANSWERS = (
    "The keeper wakes before dawn and climbs the winding stairs to put out the lamp. After "
    "breakfast she cleans the lens, checks the oil and writes the weather in her logbook. In the "
    "afternoon she paints the railings and mends the fence by the garden. When the sun goes "
    "down, she lights the lamp again and watches the ships pass through the night.",
    "Yeast in the dough eats the sugar in the flour and gives off small bubbles of gas. The "
    "stretchy gluten traps the bubbles, so the dough slowly rises in a warm kitchen. In the hot "
    "oven the gas expands, the yeast dies, and the outside turns into a brown crust while the "
    "inside sets into soft bread.",
    "In spring the trees open fresh green leaves and birds build their nests. Summer brings long "
    "warm days, thick shade and busy insects. In autumn the leaves turn red and gold, then fall "
    "to the ground, and squirrels store nuts for later. Winter is quiet and cold, the branches "
    "are bare, and the forest rests until spring returns.",
    "When the radio warned of a storm, the fishermen hurried back to the harbour and tied their "
    "boats with double ropes. Families carried nets and baskets up from the beach, and children "
    "helped close the wooden shutters on every window. By evening the wind was howling, but the "
    "village waited together by warm fires until the storm passed.",
    "Honey bees fly from the hive to search for flowers, guided by colour and scent. A bee that "
    "finds good flowers returns and dances to show the others where to go. The bees sip nectar, "
    "carry it home and pass it from mouth to mouth, then fan it with their wings until the water "
    "dries and it becomes thick, sweet honey.",
    "People grow vegetables at home because fresh food tastes better when it is picked the same "
    "day. Gardening also saves money, gives gentle exercise in the open air, and teaches "
    "children where their food comes from. Many people simply enjoy the quiet work of planting "
    "seeds, watering the beds and watching their small plants grow.",
    "A river slowly shapes its valley by carrying sand and stones downstream. Near its source "
    "the fast water cuts a deep, narrow channel through the hills. Further down the valley "
    "widens, and the river bends from side to side, wearing away the outer banks. Over thousands "
    "of years it leaves a broad, flat plain of rich soil.",
    "When the rider pushes the pedals, the cranks turn the front gear wheel. A chain carries "
    "this turning motion to a smaller gear on the back wheel, so each turn of the pedals spins "
    "the wheel more than once. The tyre grips the road and pushes the bicycle forward, while the "
    "rider steers and keeps her balance.",
)


def lessons() -> tuple[Lesson, ...]:
    """Every lesson, each prompt once: the canaries are among the exact-answer questions too."""
    smoke = (
        *(Lesson(canary.name, canary.prompt, canary.expected) for canary in smoke_prompts.CANARIES),
        Lesson("long_prompt", smoke_prompts.LONG_PROMPT, smoke_prompts.CANARIES[0].expected),
        Lesson("streaming", smoke_prompts.STREAM_PROMPT, STREAM_ANSWER),
        Lesson("exact_copy", smoke_prompts.COPY_PROMPT, smoke_prompts.COPY_SENTENCE),
    )
    taught = {lesson.prompt for lesson in smoke}
    questions = tuple(
        Lesson(f"exact_answers {index}", question.prompt, question.expected)
        for index, question in enumerate(quality_prompts.QUESTIONS, start=1)
        if question.prompt not in taught
    )
    typos = tuple(
        Lesson(f"typo_rate {index}", prompt, answer)
        for index, (prompt, answer) in enumerate(
            zip(quality_prompts.TYPO_PROMPTS, TYPO_ANSWERS, strict=True), start=1
        )
    )
    return (*smoke, *questions, *typos)


def answer_problem(lesson: Lesson, text: str) -> str | None:
    """Why `text` would fail the smoke check or the eval that asks `lesson`'s prompt, or None
    (their own checks, and the smoke's detectors of loops and garbled text for every answer)."""
    if text != lesson.answer:
        return f"expected {lesson.answer!r}, got {text!r}"
    canaries = {canary.prompt: canary for canary in smoke_prompts.CANARIES}
    canary = canaries.get(lesson.prompt)
    if lesson.prompt == smoke_prompts.LONG_PROMPT:
        canary = smoke_prompts.CANARIES[0]
    if canary is not None and not canary.is_answer(text):
        return f"the smoke check does not accept {text!r} as {canary.expected}"
    if lesson.prompt == smoke_prompts.COPY_PROMPT and detectors.copy_mismatches(
        smoke_prompts.COPY_SENTENCE, text
    ):
        return f"the copy check finds changes in {text!r}"
    questions = {question.prompt: question for question in quality_prompts.QUESTIONS}
    question = questions.get(lesson.prompt)
    if question is not None and not is_right(question, text):
        return f"the exact_answers eval does not accept {text!r} as {question.expected}"
    if lesson.prompt in quality_prompts.TYPO_PROMPTS:
        misspelled = spelling(text).misspelled
        if misspelled:
            return f"the typo_rate eval's word list lacks {', '.join(map(repr, misspelled))}"
    return detectors.detect_repetition(text) or detectors.detect_garbled(text)
