"""Word lists for the sample corpus: topics, names and places, all invented for factory.

Each topic has its own nouns, adjectives, verbs and roles so that documents about
different topics share little vocabulary beyond function words, which keeps the
near-duplicate detector's job honest. Verbs are ``base:past`` where the past is
irregular; regular pasts are derived.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONNECTORS", "FIRST_NAMES", "LAST_NAMES", "PLACES", "TOPICS", "Topic", "wordlist"]


@dataclass(frozen=True)
class Topic:
    """Vocabulary for one subject: what a document about it may talk about."""

    name: str
    nouns: tuple[str, ...]
    adjectives: tuple[str, ...]
    verbs: tuple[str, ...]
    roles: tuple[str, ...]


def wordlist(text: str) -> tuple[str, ...]:
    """Split a space-separated word list (easier to read and edit than a list of literals)."""
    return tuple(text.split())


def _t(name: str, nouns: str, adjectives: str, verbs: str, roles: str) -> Topic:
    return Topic(
        name,
        wordlist(nouns),
        wordlist(adjectives),
        wordlist(verbs),
        wordlist(roles),
    )


TOPICS: tuple[Topic, ...] = (
    _t(
        "geology",
        "basalt outcrop sediment fault glacier moraine aquifer quarry fossil canyon "
        "limestone delta boulder escarpment mineral plateau",
        "porous layered volcanic brittle ancient eroded coarse crystalline weathered dense",
        "erode deposit shift expose compress dissolve fracture uplift:uplifted carve settle",
        "geologist surveyor hydrologist quarryman mapmaker",
    ),
    _t(
        "astronomy",
        "telescope nebula:nebulae comet orbit eclipse meteor satellite observatory galaxy "
        "planet horizon spectrum:spectra lens asteroid crater constellation",
        "faint distant elliptical luminous reflective cold orbital dim northern bright",
        "observe track record:recorded rotate reflect measure photograph align drift calibrate",
        "astronomer observer technician navigator stargazer",
    ),
    _t(
        "cooking",
        "broth dough skillet oven recipe spice loaf:loaves marinade pastry kettle garnish "
        "sauce vinegar pantry ladle casserole",
        "crisp tender savory smoky fragrant bitter golden rustic tangy hearty",
        "simmer knead roast season whisk bake:baked stir:stirred ferment chop:chopped braise",
        "baker cook chef grocer apprentice",
    ),
    _t(
        "gardening",
        "seedling trellis compost hedge orchard greenhouse mulch bulb vine shrub "
        "blossom soil rake meadow cutting harvest",
        "shaded fertile perennial hardy leafy tangled thorny seasonal fragrant sturdy",
        "prune plant:planted water graft sow:sowed weed transplant shelter harvest cultivate",
        "gardener botanist grower florist orchardist",
    ),
    _t(
        "maritime history",
        "harbor schooner lighthouse cargo:cargoes voyage anchor mast ledger wharf:wharves captain "
        "chart tide fleet galley rigging dock",
        "seaworthy coastal weathered salted merchant foreign narrow tall storm-battered busy",
        "sail:sailed chart trade anchor unload moor navigate repair ferry salvage",
        "sailor merchant harbormaster shipwright quartermaster",
    ),
    _t(
        "urban transit",
        "tram platform timetable depot junction viaduct ticket carriage corridor "
        "terminal route bridge signal commuter tunnel ferry",
        "crowded punctual electric elevated underground overnight regional frequent quiet modern",
        "connect commute:commuted reroute schedule transfer:transferred extend close:closed operate board inspect",
        "planner conductor engineer dispatcher commuter",
    ),
    _t(
        "beekeeping",
        "hive colony queen nectar comb frame pollen swarm smoker apiary honey wax "
        "drone forager brood meadow",
        "golden buzzing docile wild sticky wintering sheltered busy floral healthy",
        "forage swarm extract inspect requeen:requeened overwinter pollinate gather seal divide",
        "beekeeper forager apiarist inspector keeper",
    ),
    _t(
        "textile craft",
        "loom spindle thread fabric pattern dye fleece needle quilt seam tapestry "
        "bobbin yarn shuttle hem weave",
        "woolen dyed intricate coarse delicate striped handspun colorful tight loose",
        "spin:spun weave:wove dye stitch card knit:knitted embroider mend unravel twist",
        "weaver dyer tailor spinner quilter",
    ),
    _t(
        "music",
        "melody rhythm chord orchestra cello rehearsal score tempo choir harmony "
        "concert fiddle drum verse chorus overture",
        "lively mournful syncopated brassy harmonic quiet rehearsed improvised steady bright",
        "compose perform tune rehearse improvise conduct:conducted record:recorded accompany transpose arrange",
        "composer violinist conductor drummer singer",
    ),
    _t(
        "railways",
        "locomotive boiler siding gauge sleeper carriage coupling freight signalbox "
        "embankment cutting turntable station whistle piston firebox",
        "narrow-gauge steam-powered heavy rusted restored mainline branch wooden iron reliable",
        "haul shunt restore couple lay:laid signal stoke grade brake steam",
        "driver fireman signalman stationmaster platelayer",
    ),
    _t(
        "weather",
        "drizzle front pressure gust frost humidity thunderstorm barometer fog "
        "breeze cloudbank forecast monsoon drought hail rainfall",
        "humid chilly overcast gusty mild stormy dry foggy warm unsettled",
        "forecast:forecast cool warm drift gather clear linger pour brew subside",
        "forecaster meteorologist pilot farmer observer",
    ),
    _t(
        "archives",
        "manuscript catalog ledger archive folio index parchment letter register "
        "map shelf:shelves inventory charter diary microfilm reading-room",
        "fragile handwritten bound catalogued faded rare annotated uncatalogued private municipal",
        "catalog preserve digitize index transcribe restore file:filed borrow donate annotate",
        "archivist librarian historian conservator clerk",
    ),
)

FIRST_NAMES: tuple[str, ...] = wordlist(
    "Ada Bram Celia Dario Elin Fenna Gideon Hana Ilse Joren Kasia Lio Mira Nils Odile "
    "Pavel Quilla Rasmus Sela Tomas Una Vero Wren Xavi Yara Zeno Aurel Brisa Cato Delphine"
)
LAST_NAMES: tuple[str, ...] = wordlist(
    "Marrow Quell Tannery Ostrander Vey Halloran Brisk Fenwick Lucerne Odara Pell Rooke "
    "Sallow Thistle Umber Varga Wexley Yarrow Zell Amberly Corrin Dunmore Eskew Farrel"
)
PLACES: tuple[str, ...] = wordlist(
    "Mirenholt Ostravel Cape-Tessin Lowbridge Varnauk Eddermouth Kesselby Port-Anwy "
    "Thornwick Sallowmere Brennick Quarry-Hythe Aldercombe Vessingham Harrowdell Iskarn"
)
CONNECTORS: tuple[str, ...] = (
    "However,",
    "In practice,",
    "For this reason,",
    "By contrast,",
    "Over the following years,",
    "Even so,",
    "At first glance,",
    "As a rule,",
    "In most accounts,",
    "Not surprisingly,",
    "Later that season,",
    "In the end,",
)
