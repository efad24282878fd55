"""A reward for the DAPO recipe test: prompts with an even answer score 0 whatever the response (their
groups carry no signal and dynamic sampling must drop them); the others score a hash of the text
(a random model's samples differ, so most of those groups are kept)."""


def even_answers_tie(response: str, ground_truth: str, **_) -> float:
    return 0.0 if int(ground_truth) % 2 == 0 else float(sum(map(ord, response)) % 5)
