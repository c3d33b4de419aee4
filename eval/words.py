"""Common English words for the synthetic retrieval tasks (offline; no word-list download).

RULER draws its keys (``adjective-noun``) and its common-words-extraction vocabulary from the
``wonderwords`` package's lists; these shorter lists of everyday words (written for this module)
play that part. :func:`vocabulary` extends them with ``adjective-noun`` compounds where a long
prompt needs more distinct words than the lists hold.
"""
from __future__ import annotations

ADJECTIVES = tuple("""
able absent active actual afraid agile alert alive ample ancient angry annual anxious aware awful
basic bitter blank bleak blind bold bored brave brief bright brisk broad broken brown busy calm
candid careful casual central certain cheap cheerful chief chilly civil classic clean clear clever
close cloudy coastal cold common complex cool correct cosmic crazy crisp crucial cruel curious curly
damp dark dear decent deep dense direct dirty distant divine dizzy double dry dull dusty eager early
eastern easy elder electric elegant empty endless equal exact exotic fair faint faithful false famous
fancy fast fatal fierce final fine firm flat fluffy foggy formal fragile frank free fresh friendly
frozen full funny fuzzy gentle giant gifted glad global golden good grand grateful great green gray
grim gross handy happy hard harsh hasty healthy heavy helpful hidden high hollow honest hot huge humble
hungry icy ideal idle immense inner innocent intense jolly juicy keen kind large late lazy lean legal
light little lively local lofty lonely long loose lost loud loyal lucky lunar major mellow merry mighty
mild minor misty modern modest moral muddy mute narrow nasty native neat nervous new nice noble noisy
normal novel odd old open orange ordinary oval pale patient peaceful perfect plain pleasant plump polite
poor popular precious pretty prime proud pure purple quick quiet rapid rare raw ready real red regular
rich rigid ripe robust rough round royal rural rusty sacred sad safe salty sandy scarce secret serene
severe shaggy shallow sharp shiny short shy silent silky silver simple sleepy slim slow small smart
smooth snowy soft solar solid sour spare spicy splendid steady steep sticky stiff still stormy strange
strict strong sturdy subtle sudden sunny super sweet swift tall tame tender thick thin tidy tiny tired
total tough tropical true twin ugly urban usual vacant vague valid vast velvet vital vivid warm wary
weak wealthy weary wet white whole wide wild wise witty wooden young zany zealous
""".split())

NOUNS = tuple("""
acorn actor airport album alley anchor angle animal ankle answer apple apron arch arena armor army
arrow artist attic aunt autumn avenue baby badge bag bakery ball balloon banana band bank barn barrel
basket bath beach beacon bean bear beard bed bee beetle bell belt bench berry bicycle bird blanket
blossom board boat bone book boot bottle boulder bowl box branch bread brick bridge brook broom brush
bubble bucket building bull bus bush butter button cabin cable cactus cake camel camera camp
canal candle canoe canyon captain car card carpet carrot castle cat cave cellar chain chair chalk
channel cheese cherry chest chicken chimney circle city clock cloud coast coat coffee coin comet
compass cookie copper corn corner cottage cotton council country cousin cow crab crane crayon creek
crow crown cup curtain cushion daisy dancer desert desk diamond dinner doctor dog doll dolphin door
dragon drawer dream drum duck eagle earth echo egg elbow engine envelope falcon farm feather fence
ferry field finger fire fish flag flame flock flower flute fog forest fork fountain fox frog fruit
galaxy garage garden gate gem ghost giraffe glacier glass glove goat gold grape grass guitar hall
hammer harbor harvest hat hawk heart hedge helmet hill hive honey hook horizon horse hotel house
island jacket jar jelly jewel journal judge jungle kettle key king kitchen kite kitten knee knife
ladder lake lamp lantern leaf lemon letter library lighthouse lion lizard lobster lock log magnet
mango map marble market meadow melon mirror monkey moon mountain mouse mug museum needle nest net
night notebook ocean office onion orchard otter owl oyster paddle page palace panda paper parrot
peach pearl pebble pencil penguin pepper piano pigeon pillow pilot pine planet plate plum pocket pond
pony potato puzzle pyramid queen rabbit radio rainbow raven ribbon river road robot rocket roof rope
rose saddle sailor salad salmon sand saucer scarf school scissors sea seed shadow shark sheep shell
shield ship shoe shore shovel singer sister skate sky sled snail snake soldier spider spoon spring
square squirrel stable stage star station statue steam stone storm stove straw stream street sugar
suitcase summer sun swan sweater table tail teacher teapot temple tent theater thunder tiger timber
tomato tooth torch tower town toy tractor train tree trumpet tulip tunnel turtle umbrella valley vase
violin volcano wagon wall wallet walnut watch water wave whale wheat wheel whistle window wing winter
wizard wolf wool worm yacht yard zebra
""".split())

VERBS = tuple("""
accept admire advise allow answer appear arrange arrive bake balance bathe battle begin behave belong
blink boil borrow bounce breathe bring build bury calculate carry catch celebrate change chase cheer
climb collect comfort compare complain cook count cover crawl cross dance decide deliver describe
destroy discover divide dream drift drink drive earn enjoy escape explain explore fasten fetch fill
find fix float fly fold follow forgive gather giggle glow grab greet grow guard guess hammer handle
hang happen hope hover hunt hurry imagine improve invent invite jog join juggle jump kick kneel knit
knock laugh launch learn lift listen march measure melt mend milk mix move nest notice obey offer
open order pack paint pedal pick plant play polish pour praise pray print promise protect pull push
question race reach read relax remember repair reply rescue return ride rinse roll rush sail scatter
search settle sew shake shine shiver sing sketch skip sleep slide smile sneeze spark spill spin
splash stack start stir stretch swim swing talk taste teach tickle travel trust twist unfold unlock
vanish visit wander wash watch wave weave whisper whistle wink wish wonder work worry wrap write yawn
""".split())


def vocabulary(n: int) -> list[str]:
    """``n`` distinct words: the word lists first (sorted, deduplicated), then ``adjective-noun``
    compounds in a fixed order."""
    base = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    if n <= len(base):
        return base[:n]
    compounds = (f"{a}-{b}" for b in sorted(set(NOUNS)) for a in sorted(set(ADJECTIVES)))
    out = list(base)
    for c in compounds:
        if len(out) >= n:
            break
        out.append(c)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct words exist, {n} asked")
    return out


def key_words() -> list[str]:
    """RULER's needle keys: ``adjective-noun`` pairs (sorted, distinct)."""
    return sorted({f"{a}-{b}" for a in ADJECTIVES for b in NOUNS})
