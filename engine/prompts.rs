//! Training prompts for proposers trained by self-distillation, disjoint
//! from every evaluation set the project ships.
//!
//! Sources (all generated here, offline, deterministic for a seed):
//! - chat: task templates filled with topics ("self-instruct" style
//!   instructions), sent through the target's chat template;
//! - code: Python function stubs with a docstring, built from verbs,
//!   nouns and argument shapes, completed as plain text;
//! - random: short runs of random vocabulary tokens that the target
//!   continues (as some public EAGLE-3 heads for small targets were
//!   trained), chosen by the caller with `random_token_prompt`.
//!
//! Invariant: no prompt returned by `training_prompts` shares an 8-gram of
//! words (lowercased alphanumeric runs) with any Spec-Bench turn or
//! HumanEval prompt (`ab::evaluation_texts`); candidates that do are
//! dropped and counted, never used.

use std::collections::HashSet;

use crate::sampler::Rng;

/// Word n-gram length of the overlap check.
pub const NGRAM: usize = 8;

/// One training prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingPrompt {
    pub text: String,
    /// Apply the chat template (instructions) or not (code completion).
    pub chat: bool,
    pub source: &'static str,
}

const TOPICS: &[&str] = &[
    "tide pools",
    "sourdough starters",
    "the history of the bicycle",
    "volcanic islands",
    "honeybee colonies",
    "paper money",
    "lighthouses",
    "the water cycle",
    "chess openings",
    "composting at home",
    "glaciers",
    "the printing press",
    "coral reefs",
    "solar panels",
    "public libraries",
    "migrating birds",
    "origami",
    "the immune system",
    "container ships",
    "desert plants",
    "jazz improvisation",
    "the moon landing",
    "rainforests",
    "mechanical watches",
    "tea ceremonies",
    "electric cars",
    "caves and stalactites",
    "board game design",
    "the Silk Road",
    "octopuses",
    "wind turbines",
    "urban gardening",
    "the human heart",
    "ancient pottery",
    "weather forecasting",
    "recycling plastics",
    "mountain railways",
    "sleep and dreams",
    "bread baking",
    "the periodic table",
    "hot air balloons",
    "sign languages",
    "earthquakes",
    "street food",
    "the first computers",
    "beekeeping",
    "river deltas",
    "knitting",
    "vaccines",
    "telescopes",
    "folk music",
    "arctic foxes",
    "the postal service",
    "camping in the rain",
    "fermentation",
    "bridges",
    "photosynthesis",
    "typewriters",
    "marathon training",
    "black holes",
    "spices",
    "submarines",
    "the metric system",
    "wildfires",
    "puppetry",
    "the stock market",
    "mushrooms",
    "railway timetables",
    "sundials",
    "penguins",
    "the Roman aqueducts",
    "learning a second language",
    "houseplants",
    "radio broadcasting",
    "snowflakes",
    "dinosaurs",
    "recipes with lentils",
    "the violin",
    "map making",
    "time zones",
    "ocean currents",
    "pottery glazes",
    "ants",
    "windmills",
    "the alphabet",
    "saving energy at home",
    "comets",
    "cheese making",
    "kites",
    "the Olympic Games",
    "salt marshes",
    "bookbinding",
    "elephants",
    "clouds",
    "the compass",
    "rock climbing",
    "batteries",
    "bonsai trees",
    "the railway age",
    "owls",
    "magnets",
    "carpentry",
    "hurricanes",
    "spreadsheets",
    "rainbows",
    "museums",
    "whales",
    "city parks",
    "the internet",
    "gardening in winter",
    "pyramids",
    "frogs",
    "recycling glass",
    "fountain pens",
    "the seasons",
    "sailing",
    "noise pollution",
    "cacti",
];

const CHAT_TASKS: &[&str] = &[
    "Tell me three surprising things about {}.",
    "Describe {} to someone who has never heard of it.",
    "Write a short poem about {}.",
    "Give me a quick overview of {}, in plain words.",
    "What are the pros and cons of {}? Answer with two short lists.",
    "Write a friendly note to a neighbour that mentions {}.",
    "Invent a short fable in which {} plays a part.",
    "How would you teach a class of children about {}?",
    "Draft a tweet that makes people curious about {}.",
    "What questions would an expert on {} want to answer next?",
    "Summarize why {} matters, in three sentences.",
    "Compare {} with something from everyday life.",
    "Write a diary entry from a person who just discovered {}.",
    "List some common myths about {} and correct them.",
    "Plan a one-day trip or activity centred on {}.",
    "Write dialogue between two friends arguing about {}.",
    "Give a step-by-step beginner's guide related to {}.",
    "What would change in the world without {}?",
    "Create a quiz of four questions about {}, with answers.",
    "Explain the history of {} as a timeline of short bullet points.",
    "Pitch a documentary film about {} in one paragraph.",
    "Write a product description for a toy inspired by {}.",
    "Suggest five names for a shop that sells things related to {}.",
    "Describe a rainy afternoon spent learning about {}.",
    "Write a haiku sequence of three haiku about {}.",
    "If {} could speak, what would it say about people?",
];

const VERBS: &[(&str, &str)] = &[
    ("count", "Count"),
    ("merge", "Merge"),
    ("rotate", "Rotate"),
    ("flatten", "Flatten"),
    ("dedupe", "Remove duplicates from"),
    ("summarize", "Compute summary statistics of"),
    ("normalize", "Normalize"),
    ("invert", "Invert"),
    ("encode", "Encode"),
    ("decode", "Decode"),
    ("validate", "Check the validity of"),
    ("group", "Group"),
    ("split", "Split"),
    ("pad", "Pad"),
    ("compress", "Run-length compress"),
    ("rank", "Rank"),
    ("clip", "Clip"),
    ("shuffle", "Deterministically interleave"),
    ("tally", "Tally"),
    ("scale", "Scale"),
    ("parse", "Parse"),
    ("render", "Render as text"),
    ("window", "Slide a window over"),
    ("pair", "Pair up"),
];

const NOUNS: &[(&str, &str)] = &[
    ("scores", "a list of integer scores"),
    ("words", "a list of words"),
    ("matrix", "a matrix given as a list of rows"),
    ("intervals", "a list of (start, end) intervals"),
    ("prices", "a list of prices in cents"),
    ("temperatures", "a list of daily temperatures"),
    ("timestamps", "a list of 'HH:MM' strings"),
    ("inventory", "a dict from item name to quantity"),
    ("grid", "a grid of characters"),
    ("ratings", "a dict from user to a list of ratings"),
    ("votes", "a list of candidate names, one per vote"),
    ("edges", "a list of (a, b) graph edges"),
    ("sentences", "a list of sentences"),
    ("bits", "a string of '0' and '1' characters"),
    ("readings", "a list of sensor readings (floats)"),
    ("paths", "a list of slash-separated file paths"),
    ("colors", "a list of (r, g, b) tuples"),
    ("points", "a list of (x, y) points"),
    ("records", "a list of dicts with 'name' and 'age' keys"),
    ("tokens", "a list of string tokens"),
];

const ARGS: &[(&str, &str)] = &[
    ("data", ""),
    ("data, limit", " Stop after `limit` elements."),
    (
        "data, reverse=False",
        " If `reverse` is true, work from the end.",
    ),
    (
        "data, key=None",
        " `key`, when given, maps each element first.",
    ),
];

/// The words of `text`: lowercased runs of alphanumeric characters.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Every `n`-gram of words in `text`, joined by spaces.
pub fn word_ngrams(text: &str, n: usize) -> Vec<String> {
    let w = words(text);
    if w.len() < n {
        return Vec::new();
    }
    w.windows(n).map(|g| g.join(" ")).collect()
}

/// The n-grams of a set of texts, for overlap checks.
#[derive(Debug, Default)]
pub struct NgramIndex {
    grams: HashSet<String>,
}

impl NgramIndex {
    pub fn new<'a>(texts: impl IntoIterator<Item = &'a str>) -> Self {
        let mut grams = HashSet::new();
        for t in texts {
            grams.extend(word_ngrams(t, NGRAM));
        }
        Self { grams }
    }

    /// The first 8-gram of `text` that the index holds.
    pub fn shared(&self, text: &str) -> Option<String> {
        word_ngrams(text, NGRAM)
            .into_iter()
            .find(|g| self.grams.contains(g))
    }

    pub fn len(&self) -> usize {
        self.grams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grams.is_empty()
    }
}

fn code_stub(verb: (&str, &str), noun: (&str, &str), args: (&str, &str)) -> String {
    format!(
        "def {v}_{n}({a}):\n    \"\"\"{V} {desc}.{extra}\n    The input is not modified; the result is a new value.\n    \"\"\"\n",
        v = verb.0,
        n = noun.0,
        a = args.0,
        V = verb.1,
        desc = noun.1,
        extra = args.1,
    )
}

/// Every candidate prompt the generators can make, in a fixed order.
fn candidates() -> Vec<TrainingPrompt> {
    let mut v = Vec::new();
    for task in CHAT_TASKS {
        for topic in TOPICS {
            v.push(TrainingPrompt {
                text: task.replace("{}", topic),
                chat: true,
                source: "chat-template",
            });
        }
    }
    for (i, verb) in VERBS.iter().enumerate() {
        for (j, noun) in NOUNS.iter().enumerate() {
            v.push(TrainingPrompt {
                text: code_stub(*verb, *noun, ARGS[(i + j) % ARGS.len()]),
                chat: false,
                source: "code-stub",
            });
        }
    }
    v
}

/// Up to `n` training prompts (about one code stub for every three chat
/// instructions), shuffled with `seed`, none sharing an 8-gram of words
/// with `evaluation`. Returns the prompts and how many candidates the
/// overlap check dropped.
pub fn training_prompts(
    n: usize,
    seed: u64,
    evaluation: &NgramIndex,
) -> (Vec<TrainingPrompt>, usize) {
    let mut all = candidates();
    let before = all.len();
    all.retain(|p| evaluation.shared(&p.text).is_none());
    let dropped = before - all.len();
    let mut rng = Rng::new(seed);
    for i in (1..all.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    (all, dropped)
}

/// A prompt of `len` random token ids from `lo..hi` (the caller keeps
/// special tokens out of the range).
pub fn random_token_prompt(rng: &mut Rng, len: usize, lo: u32, hi: u32) -> Vec<u32> {
    let span = hi.saturating_sub(lo).max(1) as u64;
    (0..len)
        .map(|_| lo + (rng.next_u64() % span) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngrams_are_word_windows_ignoring_case_and_punctuation() {
        let g = word_ngrams("One, two THREE four five six seven eight nine!", 8);
        assert_eq!(
            g,
            vec![
                "one two three four five six seven eight",
                "two three four five six seven eight nine"
            ]
        );
        assert!(word_ngrams("too short", 8).is_empty());
        let idx = NgramIndex::new(["a b c d e f g h"]);
        assert!(idx.shared("x A-B-C d e f g h y").is_some());
        assert!(idx.shared("a b c d e f g x").is_none());
    }

    #[test]
    fn overlapping_candidates_are_dropped() {
        // An evaluation set that contains one of the generated prompts.
        let all = candidates();
        let victim = all[5].text.clone();
        let idx = NgramIndex::new([victim.as_str()]);
        let (got, dropped) = training_prompts(usize::MAX, 1, &idx);
        assert!(dropped >= 1);
        assert!(got.iter().all(|p| p.text != victim));
        assert_eq!(got.len() + dropped, all.len());
    }
}
