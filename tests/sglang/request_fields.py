"""Request fields shared by conftest (the single server's references) and the PD tests that
compare against them. A module of its own because `from conftest import ...` resolves to whichever
conftest.py pytest put first on sys.path (tests/transport's in a full run)."""

# What a chat client asks for beside the tokens: the chosen token's logprob and the top 3.
LOGPROB_FIELDS = {"return_logprob": True, "top_logprobs_num": 3}
# A grammar-constrained request (SGLang's default xgrammar backend): long enough to speculate
# past a few tokens, loose enough that the model still chooses.
GRAMMAR_SAMPLING = {"regex": r" [A-Z][a-z]{2,9}(, [a-z]{2,9}){2,4}, and [a-z]{2,9}\."}
