"""What the prompt filter changes of better-profanity's shipped word list, as data:
the words it leaves out, the few it adds, and which of the list's words are
sexual. Keys are as the filter normalises an entry (``prompt_filter``): lower
case, accents and leetspeak folded, a phrase's words joined by one space.

better-profanity's list (MIT) is a list against swearing in chat, not an image
policy: as shipped it refuses "a fat cat", "god rays", "a pipe organ", "a blue
tit on a branch", "homo sapiens", "a Maine coon" and "a gay couple". An operator
who wants any of these refused after all adds them to DARKROOM_PROMPT_FILTER_WORDS."""

from __future__ import annotations

# Left out of the shipped list, by why.
EXCLUDED: frozenset[str] = frozenset(
    {
        # Ordinary words of image prompts (and names) that the list holds for their slang sense.
        *("cow girl", "cow girls", "cowgirl", "cowgirls", "dink", "dinks", "doofus", "dopey", "dummy", "flange"),
        *("facial", "fanny", "f4nny", "foobar", "fubar", "frigg", "frigga", "guido", "hebe", "herp", "hoar"),
        *("hoare", "homey", "hump", "knob", "nob", "len", "asanchez", "loin", "loins", "maxi", "muff", "nad"),
        *("nappy", "niggle", "nimrod", "ninny", "nutbutter", "organ", "paddy", "pasty", "pawn", "pollock", "puss"),
        *("revue", "rump", "sandbar", "screw", "seaman", "seamen", "shag", "slope", "snatch", "snuff", "sodom"),
        *("spick", "stroke", "strip", "suck", "sucked", "sucking", "teat", "teste", "testee", "thrust", "tinkle"),
        *("tit", "titi", "toots", "tramp", "vixen", "wad", "wang", "dong", "wedgie", "weenie", "whiz", "willies"),
        *("willy", "woody", "wazoo", "xx", "yury", "chink", "coon", "negro", "reich", "arian", "leper", "fingering"),
        *("erect", "steamy", "racy", "seduce", "lust", "lusty", "lusting", "penetrate", "penetration", "kinky"),
        *("enlargement", "lube", "quicky", "playboy", "undies", "oral", "orally", "pee", "poop", "potty"),
        # Mild insults and exclamations, nothing an image shows.
        *("crap", "damn", "god", "hell", "he11", "fat", "ugly", "stupid", "moron", "weirdo", "jerk", "prude"),
        *("prig", "sissy", "thug", "trashy", "tawdry", "vulgar", "sleaze", "sleazy", "scum", "omg", "lmao"),
        *("wench", "unwed"),
        # Who someone is, never a refusal (the list's slurs for the same people stay).
        *("gay", "gays", "gai", "gae", "gey", "ghay", "ghey", "homo", "h0m0", "h0mo", "hom0", "lesbians"),
        *("queer", "queers", "transsexual", "virgin"),
        # The body as medicine sees it.
        *("ovary", "ovum", "ovums", "uterus", "womb", "menses", "menstruate", "menstruation", "rectus"),
        *("urinal", "urine", "vomit", "tampon", "herpes", "hiv", "pms", "gonad", "gonads"),
        # Drink and drugs: outside what this filter is for (nor does open_nsfw see them).
        *("rum", "vodka", "weed", "hemp", "hookah", "hooch", "hootch", "drunk", "souse", "soused", "pot"),
        *("ganja", "heroin", "meth", "opiate", "opium", "pcp", "peyote", "reefer", "scag", "skag", "stoned"),
        *("toke", "junkie", "junky", "valium", "viagra", "v14gra", "v1gra", "extacy", "extasy"),
        # Violence and weapons: outside what this filter is for, as for open_nsfw.
        *("kill", "murder", "howtokill", "howtomurdep", "sniper", "uzi", "napalm", "slave"),
    }
)

# Added to the shipped list, all sexual: what people ask an image model for that
# a list against swearing in chat does not hold.
ADDED: tuple[str, ...] = (
    *("nsfw", "nudity", "topless", "bottomless", "pornographic", "genitals", "genitalia", "areola", "areolae"),
    *("upskirt", "cameltoe", "ahegao", "creampie", "paizuri", "loli", "lolicon", "shotacon", "rule34"),
)

# The shipped list's words and phrases that are sexual (sex acts, genitals,
# pornography, sexual abuse), beside ADDED: the rest are insults, slurs and
# swearing ("profanity" only).
SEXUAL: frozenset[str] = frozenset(
    {
        *ADDED,
        *("2 girls 1 cup", "anal", "areole", "auto erotic", "autoerotic", "bdsm", "beastial", "beastiality"),
        *("bestial", "bestiality", "blow job", "blowjob", "blowjobs", "bondage", "boner", "boob", "boobs"),
        *("booobs", "boooobs", "booooobs", "booooooobs", "booty call", "breasts", "bukake", "bukkake", "busty"),
        *("clit", "clitoris", "clits", "cock", "cocks", "cocksuck", "cocksucked", "cocksucker", "cocksucking"),
        *("cocksucks", "cum", "cuming", "cummer", "cumming", "cums", "cumshot", "cunilingus", "cunillingus"),
        *("cunnilingus", "deep throat", "deepthroat", "dildo", "dildos", "dog style", "doggie style"),
        *("doggiestyle", "doggy style", "doggystyle", "ejaculate", "ejaculated", "ejaculates", "ejaculating"),
        *("ejaculatings", "ejaculation", "ejakulate", "erection", "erotic", "erotism", "fellate", "fellatio"),
        *("femdom", "fingerfuck", "fingerfucked", "fingerfucker", "fingerfuckers", "fingerfucking"),
        *("fingerfucks", "fisting", "fistfuck", "fistfucked", "fistfucker", "fistfuckers", "fistfucking"),
        *("fistfuckings", "fistfucks", "foot job", "footjob", "foreskin", "futanari", "futanary", "g spot"),
        *("gspot", "gang bang", "gangbang", "gangbanged", "gangbangs", "gaysex", "golden shower", "goldenshower"),
        *("gokkun", "hand job", "handjob", "hardcoresex", "hardon", "hentai", "homoerotic", "horniest", "horny"),
        *("hotsex", "incest", "jack off", "jackoff", "jerk off", "jerkoff", "jiz", "jizm", "jizz", "jizzed"),
        *("kinbaku", "labia", "masterbate", "masterbating", "masterbation", "masterbations"),
        *("masturbate", "masturbating", "masturbation", "milf", "molest", "naked", "nipple", "nipples", "nude"),
        *("nudes", "nympho", "orgasim", "orgasims", "orgasm", "orgasmic", "orgasms", "orgies", "orgy", "pedo"),
        *("pedophile", "pedophilia", "pedophiliac", "penial", "penile", "penis", "phonesex", "porn", "porno"),
        *("pornography", "pornos", "pron", "pube", "pubic", "pussy", "pussies", "rape", "raped", "raper"),
        *("raping", "rapist", "rimjob", "rimming", "scrotum", "semen", "sex", "sexual", "she male", "shemale"),
        *("shibari", "shota", "smegma", "sperm", "strip club", "stripclub", "teabagging", "testicle"),
        *("three some", "threesome", "throating", "titfuck", "tits", "titties", "titty", "tittyfuck", "vagina"),
        *("vulva", "voyeur", "wank", "wanker", "wanky", "xxx", "yaoi"),
    }
)
