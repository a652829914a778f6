"""The ocr reward: edit distance, Flow-GRPO's text-rendering score, and OCRScore on a tiny random GOT-OCR 2.0."""
import functools
import random
import string

import numpy as np
import pytest
import torch

import common


def _distance_by_recursion(a: str, b: str) -> int:
    """Every edit script, tried first edit by first edit (memoised only to keep it fast)."""
    @functools.cache
    def d(i, j):  # distance between a[i:] and b[j:]
        if i == len(a) or j == len(b):
            return len(a) - i + len(b) - j
        return min(d(i + 1, j) + 1, d(i, j + 1) + 1, d(i + 1, j + 1) + (a[i] != b[j]))
    return d(0, 0)


@pytest.mark.parametrize("a,b,d", [("", "", 0), ("", "abc", 3), ("abc", "", 3), ("abc", "abc", 0),
                                   ("kitten", "sitting", 3), ("flaw", "lawn", 2), ("intention", "execution", 5),
                                   ("ab", "ba", 2), ("Hello", "hello", 1)])
def test_edit_distance_known_pairs(a, b, d):
    assert common.edit_distance(a, b) == common.edit_distance(b, a) == d


def test_edit_distance_equals_the_recursion_over_all_edit_scripts():
    rng = random.Random(0)
    for _ in range(400):
        a, b = ("".join(rng.choices("ab c", k=rng.randint(0, 7))) for _ in range(2))
        assert common.edit_distance(a, b) == _distance_by_recursion(a, b), (a, b)


def test_ocr_reward_hand_cases():
    r = common.ocr_reward
    assert r("Hello World", 'a neon sign that says "Hello World" at night') == 1.0
    assert r("HELLOWORLD", 'a sign "hello world"') == r("hello\nworld", 'a sign "Hello  World"') == 1.0
    assert r("helloworld", 'a sign "Hello\tWorld"') == 1.0                    # every whitespace character goes
    assert r("hellaworld", 'a sign "hello world"') == pytest.approx(0.9)     # one substitution in 10 characters
    assert r("hell world", 'a sign "hello world"') == pytest.approx(0.9)     # one deletion
    assert r("OPEN 24 hours, welcome in", 'a shop door, "Welcome" on it') == 1.0  # the target inside the text: d = 0
    assert r("", 'a sign "abc"') == 0.0
    assert r("xyz" * 10, 'a sign "abc"') == 0.0                              # distance 30, capped at 3
    assert r("ab" + "x" * 10, 'a sign "abc"') == 0.0                         # distance 10, capped at 3
    assert r("STOP", "stop") == 1.0 and r("stap", "Stop") == pytest.approx(0.75)  # no quotes: the whole prompt
    assert r("one", 'say "one", then "two"') == 1.0                          # the first quoted text only
    assert r("tw", 'say "one", then "two"') == 0.0
    assert r("hello", 'a sign reading "hello') == 1.0                       # an unmatched quote: the rest
    assert r("anything", 'an empty sign ""') == r("", 'an empty sign ""') == 1.0  # empty target: contained
    rng = random.Random(1)
    for _ in range(200):
        text, target = ("".join(rng.choices("aB c", k=rng.randint(0, 6))) for _ in range(2))
        score = r(text, f'a sign "{target}"')
        assert 0.0 <= score <= 1.0
        assert (score == 1.0) == (target.replace(" ", "").lower() in text.replace(" ", "").lower())


def _tiny_got_ocr(path):
    """A tiny random GOT-OCR 2.0 saved like the hub repository (model, preprocessor_config.json, tokenizer files).
    The tokenizer is a byte-level BPE over letters, digits, a little punctuation (no double quote) and the special
    tokens of GOT's prompt. Weight matrices are redrawn with a large spread (seed chosen) so that what it reads
    depends on the image and, on the test's images, reads end at <|im_end|>, at <|endoftext|> and at 16 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = string.ascii_letters + string.digits + " .,:!?'-\n"
    bpe = Tokenizer(models.BPE(vocab={byte_level.pre_tokenize_str(c)[0][0]: i for i, c in enumerate(chars)}, merges=[]))
    bpe.pre_tokenizer, bpe.decoder = byte_level, decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|endoftext|>", additional_special_tokens=specials)
    cfg = GotOcr2Config(vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=64, patch_size=8, window_size=4,
                                           global_attn_indexes=[1], mlp_dim=32),
                        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512),
                        image_token_index=tok.convert_tokens_to_ids("<imgpad>"))
    torch.manual_seed(77)
    model = GotOcr2ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(path)
    tok.save_pretrained(path)


def test_ocr_score_reads_as_unbatched_generation_does_and_scores_with_ocr_reward(tmp_path):
    from PIL import Image
    from transformers import GotOcr2ForConditionalGeneration, GotOcr2Processor
    path = tmp_path / "got"
    _tiny_got_ocr(path)
    assert common.REWARDS["ocr"] is common.OCRScore
    scorer = common.OCRScore(model_id=str(path), max_new_tokens=16)
    assert type(scorer.processor.image_processor).__name__ == "GotOcr2ImageProcessorPil"
    imgs = torch.rand(4, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    imgs[1], imgs[2], imgs[3] = 0.0, 1.0, (imgs[3] > 0.5).float()
    read = scorer.recognise(imgs)
    prompts = [f'a sign that says "{read[0]}"', f'"{read[1]}x" in neon letters', read[2].upper(), 'a poster, "abc"']
    scores = scorer(imgs, prompts)

    # independent path: the processor on each PIL image, greedy generate stopping as the model card does, decode
    model = GotOcr2ForConditionalGeneration.from_pretrained(path).eval()
    proc = GotOcr2Processor.from_pretrained(path)
    tok = proc.tokenizer
    expected, ends = [], set()
    for a in (imgs.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8):
        inputs = proc(Image.fromarray(a), num_image_tokens=4, return_tensors="pt")  # 64 px / 8 px patches / 4, squared
        out = model.generate(**inputs, do_sample=False, max_new_tokens=16, tokenizer=tok, stop_strings="<|im_end|>",
                             eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
        new = out[0, inputs["input_ids"].shape[1]:]
        expected.append(tok.decode(new, skip_special_tokens=True))
        ends.add(tok.convert_ids_to_tokens(new[-1].item()) if len(new) < 16 else "max_new_tokens")
    assert ends == {"<|im_end|>", "<|endoftext|>", "max_new_tokens"}  # every way a read ends is exercised
    assert scorer.last_texts == read == expected
    assert len(set(read)) > 1 and any(read)  # what it reads depends on the image
    assert scores.shape == (4,) and scores.dtype == torch.float32
    expected_scores = torch.tensor([common.ocr_reward(t, p) for t, p in zip(read, prompts)], dtype=torch.float32)
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=0)
    assert ((scores >= 0) & (scores <= 1)).all()
