"""Stage 1 of the draft trainer: the prompts the target answers (self-distillation data).

Templates (tasks x topics, how-tos, code requests, raw-text openings) give `n` distinct
prompts; chat ones go through the tokenizer's chat template as the engine applies it. CPU only:
`eaglekv train-draft prompts --out prompts.json`.
"""

from __future__ import annotations

import random

TASKS = [
    "Explain {t} in simple terms.", "Explain {t} to a ten-year-old.", "What is {t}?",
    "Describe {t}.", "Give me a short overview of {t}.", "Write a short story about {t}.",
    "Write a poem about {t}.", "Write a haiku about {t}.", "List five facts about {t}.",
    "List the pros and cons of {t}.", "Compare {t} and {u}.",
    "What is the difference between {t} and {u}?", "How does {t} work?",
    "Summarize the history of {t}.", "Why is {t} important?", "Give three tips about {t}.",
    "Write a short essay about {t}.", "Write a blog post introduction about {t}.",
    "What are common misconceptions about {t}?", "Explain how {t} relates to {u}.",
    "Write a dialogue between two friends about {t}.", "Write a product description for {t}.",
    "Give me a step-by-step guide to learning about {t}.", "What are the main uses of {t}?",
    "Write an email to a colleague about {t}.", "Tell me a fun fact about {t}.",
    "What questions should I ask to understand {t}?", "Describe a day in the life of {t}.",
    "Write a limerick about {t}.", "What would happen if {t} disappeared?",
    "Can you help me understand {t}?", "Write a news headline and a short article about {t}.",
    "Give an example of {t} in everyday life.", "What are the benefits of {t}?",
    "Write a letter to {t}.", "Summarize {t} in three sentences.",
    "Make a quiz with three questions about {t}.", "Describe {t} using only simple words.",
]
HOWTO = [
    "How do I {a}?", "What is the best way to {a}?", "Give me step-by-step instructions to {a}.",
    "What are some tips to {a}?", "I want to {a}. Where should I start?",
    "Write a short guide on how to {a}.", "What mistakes should I avoid when I {a}?",
]
TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes",
    "climate change", "the moon", "the solar system", "gravity", "electricity", "magnetism",
    "the human heart", "the immune system", "DNA", "evolution", "dinosaurs", "bees", "whales",
    "octopuses", "penguins", "elephants", "cats", "dogs", "a lighthouse keeper", "a robot",
    "a dragon", "a wizard", "a lonely astronaut", "a detective", "a talking tree", "pirates",
    "the ocean", "rainforests", "deserts", "mountains", "rivers", "the Arctic", "autumn",
    "winter", "spring", "summer", "friendship", "kindness", "courage", "happiness", "time",
    "music", "jazz", "classical music", "painting", "photography", "poetry", "chess", "soccer",
    "basketball", "the Olympic Games", "yoga", "meditation", "sleep", "healthy eating",
    "coffee", "tea", "chocolate", "bread", "pizza", "sushi", "cooking pasta", "gardening",
    "composting", "recycling", "solar energy", "wind power", "nuclear energy", "batteries",
    "electric cars", "airplanes", "trains", "bicycles", "the internet", "email",
    "social media", "smartphones", "computers", "programming", "Python", "JavaScript",
    "databases", "machine learning", "neural networks", "artificial intelligence", "robots",
    "cryptography", "passwords", "cloud computing", "video games", "virtual reality",
    "3D printing", "the printing press", "the Roman Empire", "ancient Egypt", "the pyramids",
    "the Renaissance", "the Industrial Revolution", "the French Revolution", "World War I",
    "the Cold War", "the moon landing", "democracy", "taxes", "inflation", "money", "banks",
    "the stock market", "budgeting", "saving money", "entrepreneurship", "marketing",
    "leadership", "teamwork", "public speaking", "job interviews", "remote work",
    "time management", "procrastination", "habits", "learning a language", "reading books",
    "libraries", "museums", "newspapers", "the theater", "movies", "cartoons", "comic books",
    "fairy tales", "mythology", "Greek gods", "the Vikings", "castles", "knights", "samurai",
    "volunteering", "charity", "cities", "villages", "farming", "cows", "horses", "honey",
    "apples", "bananas", "rice", "potatoes", "vitamins", "exercise", "running", "swimming",
    "hiking", "camping", "travel", "maps", "compasses", "stars", "galaxies", "Mars", "Jupiter",
    "comets", "telescopes", "microscopes", "bacteria", "viruses", "vaccines", "antibiotics",
    "the brain", "memory", "dreams", "emotions", "empathy", "curiosity", "creativity",
    "mathematics", "prime numbers", "fractions", "geometry", "probability", "statistics",
    "algebra", "calculus", "physics", "chemistry", "biology", "geology", "weather", "clouds",
    "rainbows", "lightning", "snow", "hurricanes", "tides", "coral reefs", "sharks",
    "butterflies", "ants", "spiders", "birds", "owls", "eagles", "trees", "flowers", "mushrooms",
    "plastic pollution", "clean water", "air quality", "a small bakery", "a busy airport",
    "a haunted house", "a secret garden", "a time machine", "a magic book", "a lost key",
    "a snowy night", "a rainy afternoon", "a birthday party", "a wedding", "a school trip",
    "a new job", "moving to a new city", "a grandmother's recipe", "an old photograph",
    "a broken clock", "the first day of school", "a football match", "a summer festival",
    "the color blue", "silence", "the wind", "the number zero", "light", "sound", "fire",
    "glass", "paper", "wood", "steel", "gold", "diamonds", "salt", "sugar", "oxygen",
    "the periodic table", "atoms", "energy", "friction", "bridges", "skyscrapers", "roads",
    "traffic", "public transport", "electric guitars", "the piano", "the violin", "drums",
    "singing", "dancing", "ballet", "sculpture", "architecture", "fashion", "recipes",
    "breakfast", "vegetarian food", "spices", "fermentation", "cheese", "ice cream", "soup",
]
ACTIONS = [
    "bake bread", "learn to code", "start a vegetable garden", "save money", "write a resume",
    "prepare for a job interview", "learn to swim", "make a cup of tea", "train a puppy",
    "reduce stress", "fall asleep faster", "study for an exam", "learn a new language",
    "start running", "clean a kitchen", "organize my desk", "plan a trip", "write a novel",
    "make new friends", "give a presentation", "change a bike tire", "cook rice",
    "make pancakes", "build a website", "take better photos", "read more books",
    "stay focused", "wake up early", "drink more water", "set goals", "learn chess",
    "paint a landscape", "write a poem", "start a podcast", "recycle at home",
    "save energy at home", "care for a houseplant", "make a budget", "learn to draw",
    "play the guitar", "meditate", "prepare a healthy lunch", "write a thank-you note",
    "back up my computer", "create a strong password", "sort a list in Python",
    "reverse a string in Python", "read a CSV file in Python", "debug my code",
]
RAW = [
    "Once upon a time, {t}", "The history of {t} begins", "{T} is", "Here are some facts about {t}:",
    "In this article, we will discuss {t}.", "Chapter 1\n\nThe morning I first saw {t},",
    "Q: What is {t}?\nA:", "Write a short story about {t}.", "Dear diary, today I learned about {t}.",
    "The most interesting thing about {t} is", "def ", "# A Python script about {t}\n",
    "Title: {T}\n\n", "Many people wonder why {t}", "Step 1:", "Introduction\n\n{T} has",
]
CODE = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "How would I write code that {c}?", "Show me a simple program that {c}.",
]
CODE_TASKS = [
    "checks if a number is prime", "reverses a string", "computes the factorial of n",
    "sorts a list of numbers", "counts the words in a sentence", "finds the largest number in a list",
    "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "returns the Fibonacci numbers up to n", "removes duplicates from a list",
    "reads a file and prints each line", "computes the average of a list",
    "merges two dictionaries", "finds the vowels in a string", "adds two matrices",
]


def build_prompts(n: int, seed: int = 0, raw_frac: float = 0.15) -> list[dict]:
    """`n` distinct prompts: {"text", "chat": bool}; chat ones get the chat template later."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        r = rng.random()
        t, u = rng.sample(TOPICS, 2)
        if r < raw_frac:
            text = rng.choice(RAW).format(t=t, T=t[:1].upper() + t[1:])
            chat = False
        elif r < raw_frac + 0.15:
            text, chat = rng.choice(HOWTO).format(a=rng.choice(ACTIONS)), True
        elif r < raw_frac + 0.22:
            text, chat = rng.choice(CODE).format(c=rng.choice(CODE_TASKS)), True
        else:
            text, chat = rng.choice(TASKS).format(t=t, u=u), True
        if (text, chat) in seen:
            continue
        seen.add((text, chat))
        out.append({"text": text, "chat": chat})
    return out


def tokenize_prompts(tokenizer, prompts: list[dict]) -> list[dict]:
    """Add "ids": chat prompts through the chat template (as `Engine.apply_chat_template`)."""
    for p in prompts:
        if p["chat"]:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}],
                                                 tokenize=False, add_generation_prompt=True)
            p["ids"] = tokenizer.encode(text, add_special_tokens=False)
        else:
            p["ids"] = tokenizer.encode(p["text"], add_special_tokens=False)
    return prompts


# ---- seed topics of the self-generated prompts (training/selfgen.py): the target writes the
# prompts itself from these, so they only need to be many and varied; the held-out split is
# by topic (selfgen.held_out_topics), so a topic's prompts never straddle train and held-out
MORE_TOPICS = [
    "nursing", "plumbing", "carpentry", "firefighters", "pilots", "farmers", "librarians",
    "teachers", "doctors", "lawyers", "architects", "electricians", "chefs", "journalists",
    "astronauts", "scientists", "engineers", "accountants", "mechanics", "veterinarians",
    "Tokyo", "Paris", "New York", "London", "Cairo", "Brazil", "India", "Canada", "Australia",
    "Kenya", "Mexico", "Iceland", "the Amazon river", "the Sahara", "the Alps", "the Himalayas",
    "the Great Wall of China", "the Silk Road", "the Pacific Ocean", "islands", "lakes", "caves",
    "knitting", "woodworking", "birdwatching", "fishing", "skateboarding", "surfing", "skiing",
    "board games", "puzzles", "origami", "pottery", "calligraphy", "stand-up comedy",
    "magic tricks",
    "a leaking faucet", "a flat tire", "a noisy neighbor", "a late train", "a job rejection",
    "a first date", "a job promotion", "a family reunion", "a power outage", "a lost wallet",
    "renting an apartment", "buying a used car", "writing a cover letter", "negotiating a salary",
    "learning to drive", "raising a teenager", "caring for elderly parents", "adopting a cat",
    "insurance", "mortgages", "credit cards", "retirement savings", "small business loans",
    "customer service", "supply chains", "shipping containers", "airports", "hospitals",
    "elections", "the constitution", "human rights", "the United Nations", "law and courts",
    "philosophy", "ethics", "logic", "Socrates", "Shakespeare", "Leonardo da Vinci",
    "Marie Curie", "Albert Einstein", "Isaac Newton", "Charles Darwin", "Ada Lovelace",
    "the Beatles", "hip hop", "opera", "film making", "animation", "podcasts", "blogging",
    "open source software", "Linux", "operating systems", "compilers", "computer networks",
    "Wi-Fi", "GPS", "satellites", "rockets", "the International Space Station", "quantum physics",
    "relativity", "thermodynamics", "optics", "sound waves", "magnets", "semiconductors",
    "climate policy", "forests", "soil", "wetlands", "endangered species", "zoos", "aquariums",
    "wolves", "frogs", "snakes", "turtles", "dolphins", "jellyfish", "parrots", "crows",
    "allergies", "headaches", "back pain", "first aid", "nutrition labels", "hydration",
    "stress", "loneliness", "motivation", "gratitude", "patience", "honesty", "forgiveness",
]
ASPECTS = [
    "{t}", "{t}", "{t}", "the history of {t}", "the science behind {t}", "everyday uses of {t}",
    "common mistakes with {t}", "the future of {t}", "{t} for beginners", "problems with {t}",
    "{t} around the world", "{t} and money", "{t} for children", "jobs related to {t}",
]
PERSONAS = [
    "a curious child", "a student", "a beginner", "an expert", "a traveler", "a parent",
    "a teacher", "a retired engineer", "a small business owner", "a journalist", "someone",
]
MATH_TOPICS = [
    "fractions", "decimals", "percentages", "ratios", "proportions", "averages", "medians",
    "probability with dice", "probability with cards", "counting combinations", "permutations",
    "prime factorization", "greatest common divisors", "least common multiples", "divisibility",
    "linear equations", "systems of equations", "quadratic equations", "inequalities",
    "exponents", "square roots", "logarithms", "arithmetic sequences", "geometric sequences",
    "areas of rectangles", "areas of circles", "triangles", "the Pythagorean theorem",
    "volumes of boxes", "volumes of cylinders", "angles", "perimeters", "coordinates",
    "slopes of lines", "unit conversions", "speed, distance and time", "train speeds",
    "work rates", "mixtures", "simple interest", "compound interest", "discounts and sales",
    "tax and tips", "shopping budgets", "recipes and scaling", "ages puzzles", "clock problems",
    "calendar problems", "money and change", "sharing equally", "remainders",
    "even and odd numbers",
    "place value", "rounding", "negative numbers", "order of operations", "matrices", "vectors",
    "derivatives", "integrals", "limits", "sets and Venn diagrams", "graphs and networks",
    "statistics of test scores", "estimation", "patterns in numbers", "binary numbers",
]
CODE_TOPICS = [
    "strings", "lists", "dictionaries", "sets", "tuples", "loops", "recursion", "sorting",
    "binary search", "linked lists", "stacks", "queues", "trees", "graphs", "hash maps",
    "reading a CSV file", "writing a JSON file", "parsing dates", "regular expressions",
    "file handling", "error handling", "classes and objects", "inheritance", "unit tests",
    "command-line arguments", "HTTP requests", "a REST API", "SQL queries", "database tables",
    "HTML forms", "CSS layouts", "JavaScript events", "async functions", "promises", "generators",
    "iterators", "decorators", "list comprehensions", "lambda functions", "matrix operations",
    "random numbers", "prime numbers in code", "string formatting", "text processing",
    "counting words", "palindromes", "anagrams", "Fibonacci numbers", "factorials",
    "temperature conversion", "a to-do list app", "a calculator program", "a guessing game",
    "tic-tac-toe", "a bank account class", "a shopping cart", "a simple web server",
    "shell scripts", "git commands", "bit manipulation", "dynamic programming", "memoization",
    "greedy algorithms", "two pointers", "sliding windows", "string compression",
    "removing duplicates", "merging sorted lists", "flattening nested lists", "caching",
    "logging", "threads", "timers", "Rust ownership", "C pointers", "Java interfaces",
    "Go goroutines", "TypeScript types", "pandas dataframes", "numpy arrays", "plotting a chart",
]
