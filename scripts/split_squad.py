"""Split a SQuAD-format JSON file by article: the first N articles to one file, the rest to another.

    python scripts/split_squad.py dev-v1.1.json --first 32 train.json eval.json

Questions about one article never land on both sides, so an evaluation on the second file measures
answers to passages the model has not trained on (SQuAD's dev articles, unlike questions, are not
in its train set). Each file keeps the input's `version`.
"""

import argparse
import json


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", help="A SQuAD-format JSON file.")
    parser.add_argument("--first", type=int, required=True, help="How many articles go to the first file.")
    parser.add_argument("first_file")
    parser.add_argument("rest_file")
    args = parser.parse_args(argv)
    with open(args.input, encoding="utf-8") as handle:
        squad = json.load(handle)
    articles = squad["data"]
    if not 0 < args.first < len(articles):
        parser.error(
            f"--first must be between 1 and {len(articles) - 1}: {args.input} has {len(articles)} articles."
        )
    for path, part in ((args.first_file, articles[: args.first]), (args.rest_file, articles[args.first :])):
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"version": squad.get("version", ""), "data": part}, handle)
        questions = sum(len(p["qas"]) for article in part for p in article["paragraphs"])
        print(f"{path}: {len(part)} articles, {questions} questions")


if __name__ == "__main__":
    main()
