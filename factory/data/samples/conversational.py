"""The ``conversational`` family: everyday assistant chats, a third of them with tools.

Records are ``{"id", "messages", "tools"?, "used_in", "meta": {"topic",
"defect"}}``. Tool chats follow the OpenAI shape: an assistant turn with
``tool_calls``, a ``tool`` turn per call (``tool_call_id``), then the answer.
"""

from __future__ import annotations

import json
import random

from factory.data.samples.common import (
    assistant,
    reasoning_fields,
    tool_call,
    tool_definition,
    tool_result,
    used_in,
)
from factory.data.samples.prose import Prose, plural
from factory.data.samples.words import FIRST_NAMES, PLACES, TOPICS

__all__ = ["conversational"]

_TOOLS = {
    "get_weather": tool_definition(
        "get_weather",
        "Get the weather forecast for a town on a given date.",
        {"town": ("string", "Town name"), "date": ("string", "ISO date, YYYY-MM-DD")},
        ["town", "date"],
    ),
    "book_table": tool_definition(
        "book_table",
        "Reserve a table at a restaurant.",
        {
            "restaurant": ("string", "Restaurant name"),
            "time": ("string", "24-hour time, HH:MM"),
            "party_size": ("integer", "Number of guests"),
        },
        ["restaurant", "time", "party_size"],
    ),
    "convert_units": tool_definition(
        "convert_units",
        "Convert a quantity between units of the same dimension.",
        {
            "value": ("number", "The quantity to convert"),
            "from_unit": ("string", "Unit of the value"),
            "to_unit": ("string", "Unit to convert to"),
        },
        ["value", "from_unit", "to_unit"],
    ),
}
_RESTAURANTS = (
    "The Copper Kettle",
    "Harbor Lantern",
    "Quince & Rye",
    "The Slow Tram",
    "Bramble House",
)
_CONVERSIONS = {("km", "miles"): 0.621371, ("kg", "pounds"): 2.20462, ("liters", "cups"): 4.22675}


def _date(r: random.Random) -> str:
    return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def _weather(r: random.Random) -> tuple[str, str, list[tuple[dict, str]], str]:
    town, date = r.choice(PLACES), _date(r)
    high, rain = r.randint(-3, 31), r.randint(0, 90)
    sky = r.choice(("sunny", "overcast", "showers", "windy", "foggy"))
    result = {"town": town, "date": date, "high_c": high, "rain_chance": rain / 100, "sky": sky}
    advice = "bring an umbrella" if rain > 50 else "you probably won't need an umbrella"
    return (
        f"I'm going to {town} on {date}. What will the weather be like?",
        f"The user wants a forecast for {town} on {date}; I should call the weather tool.",
        [({"town": town, "date": date}, json.dumps(result))],
        f"The forecast for {town} on {date} is {sky} with a high of {high} degrees Celsius and a "
        f"{rain}% chance of rain, so {advice}.",
    )


def _booking(r: random.Random) -> tuple[str, str, list[tuple[dict, str]], str]:
    place, size = r.choice(_RESTAURANTS), r.randint(2, 8)
    time = f"{r.randint(17, 21)}:{r.choice(('00', '15', '30', '45'))}"
    ref = f"R{r.randint(10000, 99999)}"
    result = {"status": "confirmed", "reference": ref, "restaurant": place, "time": time}
    return (
        f"Can you book a table for {size} at {place} at {time} tonight?",
        f"Booking request: {place}, {time}, {size} guests. All required fields are present.",
        [({"restaurant": place, "time": time, "party_size": size}, json.dumps(result))],
        f"Done! Your table for {size} at {place} is confirmed for {time}. "
        f"The booking reference is {ref}.",
    )


def _convert(r: random.Random) -> tuple[str, str, list[tuple[dict, str]], str]:
    (src, dst), factor = r.choice(sorted(_CONVERSIONS.items()))
    value = r.randint(2, 250)
    out = round(value * factor, 2)
    return (
        f"How many {dst} is {value} {src}?",
        f"A unit conversion from {src} to {dst}; the tool gives an exact factor.",
        [
            (
                {"value": value, "from_unit": src, "to_unit": dst},
                json.dumps({"result": out, "unit": dst}),
            )
        ],
        f"{value} {src} is about {out} {dst}.",
    )


_TOOL_TASKS = {"get_weather": _weather, "book_table": _booking, "convert_units": _convert}


def _plain_turn(r: random.Random) -> tuple[str, str, str, str]:
    """(topic, user request, reasoning, answer) for a chat without tools."""
    kind = r.choice(("explain", "trip", "email", "recipe"))
    if kind == "explain":
        topic = r.choice(TOPICS)
        prose = Prose(r, topic)
        noun = topic.nouns[0]
        return (
            topic.name,
            f"Can you tell me something interesting about {topic.name}? I know almost nothing about it.",
            f"They are a beginner, so I should keep the explanation about {plural(noun)} concrete.",
            f"Happy to! {prose.paragraph(3, 5)}\n\n{prose.paragraph(2, 4)}",
        )
    if kind == "trip":
        place, days = r.choice(PLACES), r.randint(1, 3)
        prose = Prose(r)
        plan = "\n".join(f"Day {d + 1}: {prose.sentence()} {prose.sentence()}" for d in range(days))
        return (
            "travel",
            f"I have {days} day(s) in {place}. What should I do there?",
            f"A {days}-day plan for {place}; one line per day with a couple of ideas each.",
            f"Here is a simple plan for {place}:\n\n{plan}",
        )
    if kind == "email":
        name, day = r.choice(FIRST_NAMES), r.choice(("Monday", "Tuesday", "Thursday", "Friday"))
        return (
            "writing",
            f"Help me write a short email to {name} moving our meeting to {day}.",
            "A short, polite email: apologise, propose the new day, ask for confirmation.",
            f"Subject: Moving our meeting to {day}\n\nHi {name},\n\nSomething has come up, so could "
            f"we move our meeting to {day} at the same time? Let me know if that works for you.\n\n"
            "Thanks, and sorry for the shuffle!",
        )
    base, guests = r.randint(2, 4), r.randint(6, 12)
    flour, butter = 150 * base, 40 * base
    scale = guests / base
    return (
        "cooking",
        f"My recipe serves {base} and uses {flour} g of flour and {butter} g of butter. "
        f"How much do I need for {guests} people?",
        f"Scale factor {guests}/{base} = {scale:.2f}; multiply each quantity.",
        f"Multiply everything by {guests}/{base}: you need {flour * scale:.0f} g of flour and "
        f"{butter * scale:.0f} g of butter.",
    )


def _tool_chat(r: random.Random) -> tuple[str, list[dict], list[dict]]:
    names = sorted(_TOOLS)
    name = r.choice(names)
    request, reasoning, calls, answer = _TOOL_TASKS[name](r)
    messages: list[dict] = [{"role": "user", "content": request}]
    made = [tool_call(r, name, args) for args, _ in calls]
    messages.append(assistant("", reasoning_fields(r, reasoning), tool_calls=made))
    messages += [tool_result(call, result) for call, (_, result) in zip(made, calls, strict=True)]
    messages.append(
        assistant(answer, reasoning_fields(r, "The tool answered; summarise it plainly."))
    )
    tools = [_TOOLS[n] for n in r.sample(names, r.randint(1, len(names))) if n != name]
    return name, messages, sorted([_TOOLS[name], *tools], key=lambda t: t["function"]["name"])


def conversational(rng: random.Random, n: int) -> list[dict]:
    """General chat (explanations, trips, emails, recipes) and tool-assisted requests."""
    records: list[dict] = []
    seen: set[str] = set()
    while len(records) < n:
        record: dict = {"id": f"conversational-{len(records):05d}"}
        if rng.random() < 0.35:
            topic, messages, tools = _tool_chat(rng)
            record.update(messages=messages, tools=tools)
        else:
            messages = []
            if rng.random() < 0.25:
                messages.append(
                    {"role": "system", "content": "You are a friendly, concise assistant."}
                )
            for turn in range(rng.choice((1, 1, 2, 3))):
                topic, request, reasoning, answer = _plain_turn(rng)
                if turn:
                    request = f"Thanks! One more thing. {request}"
                messages += [
                    {"role": "user", "content": request},
                    assistant(answer, reasoning_fields(rng, reasoning)),
                ]
            record["messages"] = messages
        key = "\n".join(m.get("content", "") for m in record["messages"])
        if key in seen:  # no unplanned exact duplicates
            continue
        seen.add(key)
        record.update(used_in=used_in(rng), meta={"topic": topic, "defect": None})
        records.append(record)
    return records
