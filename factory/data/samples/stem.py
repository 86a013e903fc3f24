"""The ``stem_synthetic`` family: science questions as chat, with reasoning traces.

Records are ``{"id", "messages", "answer", "used_in", "meta": {"topic",
"defect"}}``. Calculation questions (kinematics, circuits, gases, moles) have
computed answers; multiple-choice questions are short facts written for factory.
A quarter are multi-turn (a follow-up asking for the key idea), and ~1% quote
a ``factory-stem-mini`` benchmark question (``meta.defect == "contaminated"``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from factory.data.samples.common import assistant, reasoning_fields, used_in
from factory.data.samples.mathematics import plant_contamination
from factory.data.samples.words import PLACES

__all__ = ["stem_synthetic"]

_MOVERS = (
    "A cart",
    "A cyclist",
    "A tram",
    "A toy car",
    "A sled on a level icy track",
    "A delivery robot",
)
_LOADS = ("A resistor", "A heating element", "A lamp filament", "A coil")
_GASES = (
    "An ideal gas",
    "A sample of helium, treated as ideal,",
    "Nitrogen, treated as an ideal gas,",
)
_SETTINGS = (
    "",
    "Homework question: ",
    "From a practice exam: ",
    "My lab partner and I disagree on this one. ",
    "Quick check for a study group in {place}: ",
    "I'm revising for a test. ",
)
Question = tuple[str, list[str], str, str]  # (question, steps, answer, key idea)

_MASSES = {"H": 1.008, "C": 12.011, "N": 14.007, "O": 15.999, "Na": 22.990, "Cl": 35.45}
_COMPOUNDS = {
    "water (H2O)": {"H": 2, "O": 1},
    "carbon dioxide (CO2)": {"C": 1, "O": 2},
    "table salt (NaCl)": {"Na": 1, "Cl": 1},
    "methane (CH4)": {"C": 1, "H": 4},
    "ammonia (NH3)": {"N": 1, "H": 3},
    "glucose (C6H12O6)": {"C": 6, "H": 12, "O": 6},
}
_FACTS = (
    ("Which organelle produces most of the ATP in a eukaryotic cell?", "the mitochondrion",
     ("the ribosome", "the Golgi apparatus", "the nucleolus"), "Cellular respiration runs in mitochondria."),
    ("Which gas do green plants take in from the air to build sugars during photosynthesis?",
     "carbon dioxide", ("oxygen", "nitrogen", "argon"), "Photosynthesis fixes carbon from carbon dioxide."),
    ("What holds the two strands of a DNA double helix together?", "hydrogen bonds between bases",
     ("ionic bonds between sugars", "peptide bonds", "disulfide bridges"), "Base pairs are joined by hydrogen bonds."),
    ("Which layer of the atmosphere holds most of the ozone?", "the stratosphere",
     ("the troposphere", "the mesosphere", "the thermosphere"), "The ozone layer sits in the stratosphere."),
    ("Which kind of rock forms when molten magma cools and hardens?", "igneous rock",
     ("sedimentary rock", "metamorphic rock", "evaporite"), "Igneous rock is cooled magma or lava."),
    ("What is the SI unit of electric charge?", "the coulomb", ("the volt", "the ohm", "the tesla"),
     "Charge is measured in coulombs."),
    ("Which planet takes the least time to orbit the Sun?", "Mercury", ("Venus", "Mars", "Neptune"),
     "Closer planets have shorter orbital periods."),
    ("Which particle in an atom carries a negative charge?", "the electron",
     ("the proton", "the neutron", "the nucleus"), "Electrons carry negative charge."),
    ("Which blood cells carry oxygen around the body?", "red blood cells",
     ("platelets", "white blood cells", "plasma cells"), "Hemoglobin in red cells binds oxygen."),
    ("What is the pH of pure water at 25 degrees Celsius?", "7", ("1", "5", "10"),
     "Pure water at room temperature is neutral."),
    ("Which law says that a gas's pressure and volume are inversely proportional at fixed temperature?",
     "Boyle's law", ("Charles's law", "Hooke's law", "Ohm's law"), "At fixed temperature, PV stays constant."),
    ("Which enzyme in saliva starts the digestion of starch?", "amylase", ("lipase", "pepsin", "trypsin"),
     "Amylase breaks starch into sugars."),
    ("What kind of wave is sound travelling through air?", "a longitudinal wave",
     ("a transverse wave", "an electromagnetic wave", "a standing wave only"),
     "Sound is a pressure wave along its direction of travel."),
    ("Which element has atomic number 6?", "carbon", ("nitrogen", "oxygen", "boron"),
     "The atomic number counts protons; carbon has six."),
)  # fmt: skip


def _kinematics(r: random.Random) -> Question:
    a, t = r.randint(1, 9), r.randint(2, 12)
    d = 0.5 * a * t * t
    return (
        f"{r.choice(_MOVERS)} starts from rest and accelerates uniformly at {a} m/s^2 for {t} s. "
        + r.choice(
            (
                "How far does it travel?",
                "What distance does it cover?",
                "Find the distance covered.",
            )
        ),
        ["From rest, distance is d = (1/2) a t^2.", f"d = 0.5 x {a} x {t}^2 = {d:g} m."],
        f"{d:g} m",
        "Under uniform acceleration from rest, distance grows with the square of time.",
    )


def _circuit(r: random.Random) -> Question:
    resistance, current = r.choice((4, 8, 10, 12, 22, 47)), r.choice((0.5, 1.5, 2, 3))
    v, p = resistance * current, resistance * current**2
    return (
        f"{r.choice(_LOADS)} of {resistance} ohms carries a current of {current} A. "
        + r.choice(
            (
                "What is the voltage across it, and how much power does it dissipate?",
                "Find the voltage across it and the power it turns into heat.",
            )
        ),
        [
            f"Ohm's law: V = I R = {current} x {resistance} = {v:g} V.",
            f"Power: P = I^2 R = {p:g} W.",
        ],
        f"{v:g} V, {p:g} W",
        "Voltage is current times resistance, and power grows with the square of the current.",
    )


def _gas(r: random.Random) -> Question:
    pressure, volume, temp = (
        r.choice((101325, 200000, 50000)),
        r.choice((0.01, 0.02, 0.05)),
        r.randint(270, 400),
    )
    n = pressure * volume / (8.314 * temp)
    return (
        f"{r.choice(_GASES)} at {temp} K and {pressure} Pa fills a {volume} m^3 vessel. How many moles "
        "of gas are in the vessel? Use R = 8.314 J/(mol K).",
        [
            "Rearrange the ideal gas law PV = nRT to n = PV / (RT).",
            f"n = {pressure} x {volume} / (8.314 x {temp}) = {n:.3f} mol.",
        ],
        f"{n:.3f} mol",
        "The ideal gas law ties pressure, volume, amount and temperature together.",
    )


def _moles(r: random.Random) -> Question:
    name = r.choice(sorted(_COMPOUNDS))
    formula = _COMPOUNDS[name]
    molar = sum(_MASSES[e] * k for e, k in formula.items())
    grams = r.randint(5, 200)
    parts = " + ".join(f"{k} x {_MASSES[e]}" for e, k in formula.items())
    return (
        r.choice(
            (
                "How many moles are in {g} g of {c}?",
                "A sample of {c} has a mass of {g} g. How many moles is that?",
                "Convert {g} g of {c} to moles.",
            )
        ).format(g=grams, c=name),
        [
            f"The molar mass is {parts} = {molar:.3f} g/mol.",
            f"Moles = {grams} / {molar:.3f} = {grams / molar:.3f} mol.",
        ],
        f"{grams / molar:.3f} mol",
        "Dividing a mass by the molar mass converts grams to moles.",
    )


def _choice(r: random.Random) -> Question:
    question, right, wrong, idea = r.choice(_FACTS)
    options = [right, *wrong]
    r.shuffle(options)
    letter = "ABCD"[options.index(right)]
    listing = "\n".join(f"{'ABCD'[i]}) {o}" for i, o in enumerate(options))
    return (
        f"{question}\n\n{listing}\n\nAnswer with the letter of the correct option.",
        [f"The correct option is {right}.", idea],
        letter,
        idea,
    )


_FAMILIES: dict[str, Callable[[random.Random], Question]] = {
    "kinematics": _kinematics,
    "circuits": _circuit,
    "gases": _gas,
    "stoichiometry": _moles,
    "multiple_choice": _choice,
}
# Few multiple-choice items: the 14 facts repeat, and a reshuffled repeat is a near-duplicate.
_WEIGHTS = {"multiple_choice": 0.3}
_SYSTEM = ("You are a careful science tutor. Show your work.", "Answer concisely and precisely.")


def stem_synthetic(rng: random.Random, n: int) -> list[dict]:
    """Science Q&A with reasoning; some records have a system turn or a follow-up turn."""
    records: list[dict] = []
    seen: set[str] = set()
    topics = sorted(_FAMILIES)
    weights = [_WEIGHTS.get(t, 1.0) for t in topics]
    while len(records) < n:
        i = len(records)
        topic = rng.choices(topics, weights)[0]
        question, steps, answer, idea = _FAMILIES[topic](rng)
        if question in seen:
            continue
        seen.add(question)
        check = (
            "The other options do not fit, so I can rule them out."
            if topic == "multiple_choice"
            else f"Checking units and magnitude, {answer} is reasonable."
        )
        reasoning = f"This is a {topic.replace('_', ' ')} question. {' '.join(steps)} {check}"
        messages: list[dict] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM)})
        setting = rng.choice(_SETTINGS).format(place=rng.choice(PLACES))
        messages += [
            {"role": "user", "content": setting + question},
            assistant("\n".join([*steps, f"Answer: {answer}"]), reasoning_fields(rng, reasoning)),
        ]
        if rng.random() < 0.25:
            messages += [
                {"role": "user", "content": "What is the key idea here, in one sentence?"},
                assistant(
                    idea,
                    reasoning_fields(rng, "They want a one-sentence summary of the principle."),
                ),
            ]
        records.append(
            {
                "id": f"stem_synthetic-{i:05d}",
                "messages": messages,
                "answer": answer,
                "used_in": used_in(rng),
                "meta": {"topic": topic, "defect": None},
            }
        )
    plant_contamination(rng, records, "factory-stem-mini")
    return records
