#!/usr/bin/env python3
"""make_corpus.py - writes data/corpus.txt, the default job's training text: about 200 KB of plain
English prose made deterministically from a small grammar (no outside text). Paragraphs separated
by an empty line are the documents. Run: python3 data/make_corpus.py > data/corpus.txt"""
import random

R = random.Random(20261129)

NAMES = ["Ada", "Ben", "Clara", "Dmitri", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kaya", "Leo",
         "Mira", "Nils", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara"]
ROLES = ["the baker", "the old fisherman", "a young engineer", "the teacher", "my neighbour", "the gardener",
         "a quiet student", "the ship's cook", "the night nurse", "the carpenter", "a travelling musician",
         "the village doctor", "the librarian", "a tired farmer", "the mapmaker"]
PLACES = ["the harbour", "the market", "the old mill", "the library", "the river bank", "the workshop",
          "the station", "the hill above the town", "the kitchen", "the lighthouse", "the orchard",
          "the school yard", "the bridge", "the forest path", "the bakery"]
TIMES = ["in the morning", "before dawn", "after lunch", "late in the evening", "on Sunday", "every spring",
         "during the storm", "at noon", "when the bells rang", "in the first week of winter", "at sunset"]
THINGS = ["a basket of apples", "the red boat", "an old map", "a loaf of bread", "the broken clock",
          "a letter", "the garden gate", "a wooden chair", "the small lamp", "a bundle of rope",
          "the blue kettle", "a jar of honey", "the heavy door", "a pair of boots", "the last ticket"]
VERBS_T = ["carried", "repaired", "found", "painted", "sold", "opened", "cleaned", "lost", "borrowed",
           "measured", "wrapped", "counted", "returned", "lifted", "noticed"]
VERBS_I = ["waited", "laughed", "sang quietly", "walked home", "slept", "listened", "worked", "hesitated",
           "ran", "smiled", "sat down", "looked around"]
ADJS = ["quiet", "bright", "cold", "busy", "narrow", "warm", "grey", "crowded", "empty", "green", "windy"]
ADVS = ["slowly", "carefully", "quickly", "gladly", "patiently", "happily", "silently", "gently"]
FEEL = ["glad", "worried", "curious", "proud", "sleepy", "surprised", "calm", "hungry"]
CONJ = ["because", "although", "while", "so that", "until", "after"]


def who():
    return R.choice(NAMES) if R.random() < 0.6 else R.choice(ROLES)


def clause():
    k = R.randrange(6)
    if k == 0:
        return f"{who()} {R.choice(VERBS_T)} {R.choice(THINGS)} {R.choice(TIMES)}"
    if k == 1:
        return f"{who()} {R.choice(VERBS_I)} near {R.choice(PLACES)}"
    if k == 2:
        return f"{R.choice(PLACES)} was {R.choice(ADJS)} {R.choice(TIMES)}"
    if k == 3:
        return f"{who()} {R.choice(ADVS)} {R.choice(VERBS_T)} {R.choice(THINGS)} at {R.choice(PLACES)}"
    if k == 4:
        return f"{who()} felt {R.choice(FEEL)}"
    return f"{who()} gave {R.choice(THINGS)} to {who()}"


def sentence():
    s = clause()
    if R.random() < 0.35:
        s += f" {R.choice(CONJ)} {clause()}"
    if R.random() < 0.15:
        s = f'"{s[0].upper() + s[1:]}," said {who()}'
        return s[0].upper() + s[1:] + "."
    return s[0].upper() + s[1:] + R.choice([".", ".", ".", "!", "?"] if R.random() < 0.1 else ["."])


def paragraph():
    return " ".join(sentence() for _ in range(R.randint(3, 7)))


def main():
    out, size = [], 0
    while size < 200_000:
        p = paragraph()
        out.append(p)
        size += len(p) + 2
    print("\n\n".join(out))


main()
