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
//! HumanEval prompt (`datasets::evaluation_texts`); candidates that do are
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

/// Texts this short (in words) are too generic to count as overlap
/// ("Why?"); longer ones under `NGRAM` words are matched whole.
const MIN_PHRASE_WORDS: usize = 4;

/// The n-grams of a set of texts, for overlap checks. A text shorter than
/// `NGRAM` words (but at least `MIN_PHRASE_WORDS`) has no n-gram: it is
/// kept whole, and a text containing its words in a row overlaps it.
#[derive(Debug, Default)]
pub struct NgramIndex {
    grams: HashSet<String>,
    /// Short texts' words, joined and padded by spaces.
    phrases: Vec<String>,
}

impl NgramIndex {
    pub fn new<'a>(texts: impl IntoIterator<Item = &'a str>) -> Self {
        let mut grams = HashSet::new();
        let mut phrases = Vec::new();
        for t in texts {
            let w = words(t);
            if w.len() < NGRAM {
                if w.len() >= MIN_PHRASE_WORDS {
                    phrases.push(format!(" {} ", w.join(" ")));
                }
            } else {
                grams.extend(w.windows(NGRAM).map(|g| g.join(" ")));
            }
        }
        phrases.sort();
        phrases.dedup();
        Self { grams, phrases }
    }

    /// The first 8-gram of `text` that the index holds.
    pub fn shared(&self, text: &str) -> Option<String> {
        self.shared_where(text, |_| true)
    }

    /// `shared`, ignoring runs of numbers and single characters ("1 2 3 4
    /// 5 6 7 8", which HumanEval's examples and any numbered list hold):
    /// for checking the target's responses, where such runs are no sign of
    /// an evaluation text.
    pub fn shared_content(&self, text: &str) -> Option<String> {
        self.shared_where(text, |g: &[String]| {
            g.iter()
                .any(|w| w.chars().count() > 1 && !w.chars().all(|c| c.is_numeric()))
        })
    }

    fn shared_where(&self, text: &str, counts: impl Fn(&[String]) -> bool) -> Option<String> {
        let w = words(text);
        if let Some(g) = w
            .windows(NGRAM)
            .filter(|g| counts(g))
            .map(|g| g.join(" "))
            .find(|g| self.grams.contains(g))
        {
            return Some(g);
        }
        if self.phrases.is_empty() || w.len() < MIN_PHRASE_WORDS {
            return None;
        }
        let padded = format!(" {} ", w.join(" "));
        self.phrases
            .iter()
            .filter(|p| {
                let pw: Vec<String> = p.split_whitespace().map(str::to_string).collect();
                counts(&pw)
            })
            .find(|p| padded.contains(p.as_str()))
            .map(|p| p.trim().to_string())
    }

    pub fn len(&self) -> usize {
        self.grams.len() + self.phrases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grams.is_empty() && self.phrases.is_empty()
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
    shuffle(&mut all, seed);
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

/// Which training prompts `specd distill` builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptMix {
    /// Topic-filled instructions and code stubs (`training_prompts`): the
    /// data every shipped head was trained on.
    #[default]
    Templated,
    /// The templated prompts interleaved with role-play, arithmetic word
    /// problems and reasoning puzzles (`varied_prompts`), then a second
    /// stage of tasks over passages the target wrote itself: summaries,
    /// extraction, translation, questions over documents, rewrites
    /// (`passage_prompts`).
    Varied,
}

impl PromptMix {
    /// `templated` or `varied` (the command line's `--prompts`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "templated" => Ok(Self::Templated),
            "varied" => Ok(Self::Varied),
            other => Err(format!("unknown prompt mix `{other}` (templated, varied)")),
        }
    }
}

const ROLES: &[&str] = &[
    "a ship's captain on a stormy night",
    "a medieval blacksmith",
    "a museum tour guide",
    "a detective in 1920s London",
    "a patient yoga teacher",
    "a grumpy but talented chef",
    "an astronaut aboard a space station",
    "a park ranger in a national forest",
    "a small-town librarian",
    "a radio sports commentator",
    "a kindergarten teacher",
    "a travel agent who loves islands",
    "a job interviewer at a bakery",
    "a customer support agent for an internet provider",
    "a fortune teller at a county fair",
    "a lighthouse keeper",
    "a retired pirate",
    "a robot learning human manners",
    "a beekeeper",
    "a hotel concierge",
];

const ROLE_ASKS: &[&str] = &[
    "Introduce yourself and describe a typical day.",
    "A visitor asks you for advice about {}. Answer in character.",
    "Tell a short story from your working life that involves {}.",
    "Stay in character and explain what you love and dislike about your work.",
    "Give three tips to someone who wants to do what you do.",
    "Calm down a visitor who is upset about a long delay.",
    "Describe the strangest thing that happened to you this week.",
    "Someone asks what you think of {}. Give an honest answer in your own voice.",
    "Write a short letter to your younger self.",
    "Explain {} the way you would to the people you meet every day.",
];

/// Arithmetic word problems; `{a}`, `{b}`, `{c}` are filled with numbers.
const MATH: &[&str] = &[
    "A shop sold {a} apples on Monday and {b} apples on Tuesday. Each apple costs {c} cents. How much money did the shop take in? Explain step by step.",
    "A train travels {a} kilometres in {c} hours. What is its average speed? Show your work.",
    "Solve for x: {c}x + {a} = {b}. Explain each step.",
    "What is {c}% of {b}? Explain how you worked it out.",
    "A garden bed is {a} metres long and {c} metres wide. What are its area and its perimeter?",
    "Maya has {a} stickers. She gives {c} to her brother and buys {b} more. How many stickers does she have now?",
    "A recipe needs {c} eggs to feed {a} people. How many eggs are needed for {b} people? Explain your answer.",
    "A water tank holds {b} litres and loses {c} litres every hour. How many hours until it is empty?",
    "What is the sum of all whole numbers from 1 to {a}? Describe the method you use.",
    "A bus has {a} passengers. At the first stop {c} get off and {b} get on. How many passengers are on the bus now?",
    "A bicycle costs {b} dollars and is on sale for {c}% off. What is the sale price?",
    "Is {a} divisible by {c}? Explain how you can tell, and give the remainder.",
    "A cinema has {a} rows of {c} seats, and {b} seats are taken. How many seats are free?",
    "Convert {b} minutes into hours and minutes, and explain the steps.",
];

const NAMES: &[&str] = &[
    "Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi",
    "Liam", "Mira", "Noah", "Olga", "Pablo",
];

/// Reasoning puzzles; `{p}`, `{q}`, `{r}` are names, `{t}` a topic.
const REASONING: &[&str] = &[
    "{p} is taller than {q}, and {q} is taller than {r}. Who is the shortest of the three? Explain your reasoning.",
    "{p}, {q} and {r} each own exactly one pet: a cat, a dog or a parrot. {p} is allergic to fur and {q} does not own the cat. Who owns which pet? Explain.",
    "{p} says that {q} is lying. {q} says that {r} is lying. {r} says that both {p} and {q} are lying. Who is telling the truth? Reason it out.",
    "If every fan of {t} owns a notebook and {p} owns a notebook, does it follow that {p} is a fan of {t}? Explain why or why not.",
    "{p} arrives before {q} but after {r}. Who arrives first, and who arrives last? Explain.",
    "A box holds red, blue and green marbles. {p} takes out marbles without looking. How many must {p} take to be sure of getting two of the same colour? Explain.",
    "{p} and {q} start reading the same book about {t} on the same day. {p} reads twice as fast as {q}. When {p} finishes, how much has {q} read? Explain.",
    "Give a careful argument for or against this claim: learning about {t} makes people more patient.",
];

/// Tasks over a passage the target wrote (`{}` is the passage).
const PASSAGE_TASKS: &[&str] = &[
    "Summarize the following text in two sentences.\n\n{}",
    "Read the text below and list its main points as bullet points.\n\n{}",
    "Translate the following text into French.\n\n{}",
    "Translate the following text into German.\n\n{}",
    "Translate the following text into Spanish.\n\n{}",
    "Extract every name, number and place mentioned in this text, as a list.\n\n{}",
    "Here is a passage:\n\n{}\n\nWrite three questions a reader could answer from it, each with its answer.",
    "Give this text a short title and explain your choice.\n\n{}",
    "Rewrite the following text so that a ten-year-old can understand it.\n\n{}",
    "Document:\n{}\n\nBased only on the document above, what is its main idea? Quote the sentence that supports your answer.",
    "Continue this text with one more paragraph in the same style.\n\n{}",
    "Make the following text more formal and fix any mistakes.\n\n{}",
    "Turn the following text into a JSON object with the keys \"topic\", \"summary\" and \"keywords\".\n\n{}",
    "What is the tone of the following text? Support your answer with examples from it.\n\n{}",
];

/// Tasks over two passages (`{0}` and `{1}`).
const TWO_PASSAGE_TASKS: &[&str] = &[
    "Document 1:\n{0}\n\nDocument 2:\n{1}\n\nUsing only these documents, explain what they have in common and how they differ.",
    "Here are two texts.\n\nText A:\n{0}\n\nText B:\n{1}\n\nWhich one would be more useful to a beginner, and why?",
    "Context:\n{0}\n\n{1}\n\nWrite a short report that combines the information above.",
];

/// The role-play, arithmetic and reasoning candidates, in a fixed order
/// (numbers and names drawn from a fixed seed).
fn extra_candidates() -> Vec<TrainingPrompt> {
    let mut v = Vec::new();
    for (i, role) in ROLES.iter().enumerate() {
        for (j, ask) in ROLE_ASKS.iter().enumerate() {
            let topic = TOPICS[(i * 7 + j * 3) % TOPICS.len()];
            v.push(TrainingPrompt {
                text: format!("Pretend you are {role}. {}", ask.replace("{}", topic)),
                chat: true,
                source: "role-play",
            });
        }
    }
    let mut rng = Rng::new(0x005E_ED0F_4A7D);
    let mut num = |lo: u64, hi: u64| (lo + rng.next_u64() % (hi - lo + 1)).to_string();
    for round in 0..16 {
        for t in MATH {
            let (a, b, c) = (num(12, 480), num(20, 900), num(2, 9 + round));
            v.push(TrainingPrompt {
                text: t.replace("{a}", &a).replace("{b}", &b).replace("{c}", &c),
                chat: true,
                source: "math",
            });
        }
    }
    for round in 0..12 {
        for (k, t) in REASONING.iter().enumerate() {
            let n = NAMES.len();
            let i = (round * 5 + k) % n;
            let (p, q, r) = (NAMES[i], NAMES[(i + 3) % n], NAMES[(i + 8) % n]);
            let topic = TOPICS[(round * 11 + k * 5) % TOPICS.len()];
            v.push(TrainingPrompt {
                text: t
                    .replace("{p}", p)
                    .replace("{q}", q)
                    .replace("{r}", r)
                    .replace("{t}", topic),
                chat: true,
                source: "reasoning",
            });
        }
    }
    v
}

/// Fisher-Yates with the project's seeded generator.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut rng = Rng::new(seed);
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// The first stage of the `varied` mix: up to `n` prompts, the templated
/// ones (`training_prompts`) interleaved with role-play, arithmetic and
/// reasoning ones, one of those for every two templated prompts while they
/// last; none sharing an 8-gram of words with `evaluation`. Returns the
/// prompts and how many candidates the overlap check dropped.
pub fn varied_prompts(
    n: usize,
    seed: u64,
    evaluation: &NgramIndex,
) -> (Vec<TrainingPrompt>, usize) {
    let (base, mut dropped) = training_prompts(usize::MAX, seed, evaluation);
    let mut extra = extra_candidates();
    let before = extra.len();
    extra.retain(|p| evaluation.shared(&p.text).is_none());
    dropped += before - extra.len();
    shuffle(&mut extra, seed ^ 0xE47A);
    let (mut base, mut extra) = (base.into_iter(), extra.into_iter());
    let mut out = Vec::new();
    while out.len() < n {
        let next = if out.len() % 3 == 2 {
            extra.next().or_else(|| base.next())
        } else {
            base.next().or_else(|| extra.next())
        };
        match next {
            Some(p) => out.push(p),
            None => break,
        }
    }
    (out, dropped)
}

/// The leading sentences of `text` up to about `max_words` words (at
/// least one sentence; a passage cut mid-sentence ends with "...").
pub fn passage(text: &str, max_words: usize) -> String {
    let text = text.trim();
    let mut out = String::new();
    let mut words = 0;
    for sentence in text.split_inclusive(['.', '!', '?', '\n']) {
        let w = sentence.split_whitespace().count();
        if words > 0 && words + w > max_words {
            break;
        }
        out.push_str(sentence);
        words += w;
    }
    if words > max_words {
        let cut: Vec<&str> = out.split_whitespace().take(max_words).collect();
        return format!("{} ...", cut.join(" "));
    }
    out.trim().to_string()
}

/// The second stage of the `varied` mix: up to `n` tasks over passages
/// (texts the target wrote in the first stage, each cut to about
/// `max_words` words), one or two passages per prompt, passages and
/// tasks assigned from `seed`; none sharing an 8-gram of words with
/// `evaluation`. Returns the prompts and how many the check dropped.
pub fn passage_prompts(
    passages: &[String],
    n: usize,
    max_words: usize,
    seed: u64,
    evaluation: &NgramIndex,
) -> (Vec<TrainingPrompt>, usize) {
    let cut: Vec<String> = passages
        .iter()
        .map(|p| passage(p, max_words))
        .filter(|p| p.split_whitespace().count() >= 12)
        .collect();
    let (mut out, mut dropped) = (Vec::new(), 0);
    if cut.is_empty() {
        return (out, dropped);
    }
    let mut rng = Rng::new(seed);
    let mut pick = |m: usize| (rng.next_u64() % m as u64) as usize;
    let mut tries = 0;
    while out.len() < n && tries < n * 4 {
        tries += 1;
        let text = if pick(5) == 0 {
            let t = TWO_PASSAGE_TASKS[pick(TWO_PASSAGE_TASKS.len())];
            let (a, b) = (pick(cut.len()), pick(cut.len()));
            let half = |p: &str| passage(p, max_words / 2);
            t.replace("{0}", &half(&cut[a]))
                .replace("{1}", &half(&cut[b]))
        } else {
            PASSAGE_TASKS[pick(PASSAGE_TASKS.len())].replace("{}", &cut[pick(cut.len())])
        };
        if evaluation.shared(&text).is_some() {
            dropped += 1;
            continue;
        }
        out.push(TrainingPrompt {
            text,
            chat: true,
            source: "passage",
        });
    }
    (out, dropped)
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
        // Texts under 8 words are matched whole (from 4 words on): a
        // training text that quotes one overlaps it.
        let idx = NgramIndex::new(["Prove the Pythagorean theorem.", "Why?"]);
        assert_eq!(
            idx.shared("First, prove the Pythagorean theorem; then rest.")
                .as_deref(),
            Some("prove the pythagorean theorem")
        );
        assert!(idx.shared("We prove the Pythagorean theorems").is_none());
        assert!(
            idx.shared("Why? Because.").is_none(),
            "too generic to count"
        );
        // Responses: runs of numbers are no sign of an evaluation text.
        let idx = NgramIndex::new(["1, 2, 3, 4, 5, 6, 7, 8 are the first", "a b c d e f g h"]);
        assert!(idx.shared("count: 1 2 3 4 5 6 7 8").is_some());
        assert!(idx.shared_content("count: 1 2 3 4 5 6 7 8").is_none());
        assert!(idx.shared_content("2 3 4 5 6 7 8 are the first").is_some());
        assert!(idx.shared_content("so a b c d e f g h").is_none());
    }

    #[test]
    fn short_evaluation_texts_drop_no_templated_prompt() {
        // Matching short evaluation texts whole must not change the
        // templated prompts the shipped heads were trained on (their
        // reproduce commands stay valid).
        let eval = crate::datasets::evaluation_texts();
        let full = NgramIndex::new(eval.iter().map(String::as_str));
        let long: Vec<&str> = eval
            .iter()
            .map(String::as_str)
            .filter(|t| words(t).len() >= NGRAM)
            .collect();
        let grams_only = NgramIndex::new(long);
        assert!(full.len() > grams_only.len(), "some texts are short");
        let (a, da) = training_prompts(usize::MAX, 7, &full);
        let (b, db) = training_prompts(usize::MAX, 7, &grams_only);
        assert_eq!((a.len(), da), (b.len(), db));
        assert!(a == b);
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

    #[test]
    fn varied_prompts_mix_every_source_and_honour_the_overlap_check() {
        let none = NgramIndex::default();
        let (got, dropped) = varied_prompts(300, 3, &none);
        assert_eq!((got.len(), dropped), (300, 0));
        for src in [
            "chat-template",
            "code-stub",
            "role-play",
            "math",
            "reasoning",
        ] {
            assert!(got.iter().any(|p| p.source == src), "no {src} prompt");
        }
        // One extra prompt in every three while both pools last.
        let extra = got[..90]
            .iter()
            .filter(|p| matches!(p.source, "role-play" | "math" | "reasoning"))
            .count();
        assert_eq!(extra, 30);
        // No placeholder is left unfilled.
        assert!(got.iter().all(|p| !p.text.contains('{')));
        // Deterministic for a seed, different across seeds.
        assert_eq!(got, varied_prompts(300, 3, &none).0);
        assert_ne!(got, varied_prompts(300, 4, &none).0);
        // An evaluation text that shares an 8-gram with a role-play
        // prompt removes it (and only what overlaps).
        let victim = got.iter().find(|p| p.source == "role-play").unwrap();
        let idx = NgramIndex::new([victim.text.as_str()]);
        let (all, dropped) = varied_prompts(usize::MAX, 3, &idx);
        assert!(dropped >= 1);
        assert!(all.iter().all(|p| idx.shared(&p.text).is_none()));
        let (every, _) = varied_prompts(usize::MAX, 3, &none);
        assert_eq!(all.len() + dropped, every.len());
    }

    #[test]
    fn passages_end_at_a_sentence_within_the_word_limit() {
        let text = "One two three. Four five six seven! Eight nine ten? Eleven.";
        assert_eq!(passage(text, 7), "One two three. Four five six seven!");
        assert_eq!(passage(text, 100), text);
        // A first sentence longer than the limit is cut and marked.
        assert_eq!(passage("a b c d e f.", 3), "a b c ...");
    }

    #[test]
    fn passage_prompts_embed_passages_and_drop_overlaps() {
        let passages: Vec<String> = (0..6)
            .map(|i| {
                format!(
                    "Passage number {i} talks about lighthouses and the sea. \
                     It has a second sentence with more words in it, number {i}. \
                     And a third one."
                )
            })
            .collect();
        let none = NgramIndex::default();
        let (got, dropped) = passage_prompts(&passages, 50, 110, 1, &none);
        assert_eq!((got.len(), dropped), (50, 0));
        for p in &got {
            assert!(p.chat && p.source == "passage");
            assert!(p.text.contains("talks about lighthouses"), "{}", p.text);
            assert!(!p.text.contains('{'), "{}", p.text);
        }
        assert!(got.iter().any(|p| p.text.contains("Document 1")
            || p.text.contains("Text A")
            || p.text.contains("Context:")));
        // Every prompt here shares this 8-gram: all are dropped.
        let idx = NgramIndex::new(["talks about lighthouses and the sea it has"]);
        let (got, dropped) = passage_prompts(&passages, 50, 110, 1, &idx);
        assert!(got.is_empty() && dropped > 0);
        // Passages too short to work on give no prompts.
        let (got, _) = passage_prompts(&["Too short.".to_string()], 5, 110, 1, &none);
        assert!(got.is_empty());
    }
}
