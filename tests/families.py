"""Tiny, randomly initialised models of the BERT-like families the recipes support, each with a
tokenizer trained here on real GLUE sentences (no download), and the tiny BERT most tests use."""

import csv
from pathlib import Path

import torch
from conftest import BERT_BASE_CONFIG, GLUE_DIR
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AlbertConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DebertaV2Config,
    DistilBertConfig,
    ElectraConfig,
    ModernBertConfig,
    PreTrainedTokenizerFast,
    RobertaConfig,
)
from transformers.utils import logging as hf_logging

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37}
# family -> (config, tokenizer kind, tokenizer outputs token_type_ids)
FAMILIES = {
    "bert": (lambda v: BertConfig(vocab_size=v, **SMALL), "wordpiece", True),
    "roberta": (
        lambda v: RobertaConfig(
            vocab_size=v,
            max_position_embeddings=258,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **SMALL,
        ),
        "bpe",
        False,
    ),
    "distilbert": (
        lambda v: DistilBertConfig(vocab_size=v, dim=32, n_layers=2, n_heads=2, hidden_dim=37),
        "wordpiece",
        False,
    ),
    "albert": (lambda v: AlbertConfig(vocab_size=v, embedding_size=16, **SMALL), "wordpiece", True),
    "electra": (lambda v: ElectraConfig(vocab_size=v, embedding_size=16, **SMALL), "wordpiece", True),
    "deberta-v2": (
        lambda v: DebertaV2Config(
            vocab_size=v, relative_attention=True, pos_att_type=["p2c", "c2p"], **SMALL
        ),
        "wordpiece",
        True,
    ),
    "modernbert": (
        lambda v: ModernBertConfig(
            vocab_size=v,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=256,
            local_attention=16,
            pad_token_id=0,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
        ),
        "wordpiece",
        False,
    ),
}


def glue_sentences(limit=600):
    """Real English sentences: the first SST-2 training sentences."""
    with open(GLUE_DIR / "SST-2" / "train.tsv", encoding="utf-8") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(rows)
        return [row[0] for _, row in zip(range(limit), rows, strict=False)]


def train_tokenizer(kind: str, with_token_types: bool) -> PreTrainedTokenizerFast:
    names = (
        ["input_ids", "token_type_ids", "attention_mask"]
        if with_token_types
        else ["input_ids", "attention_mask"]
    )
    if kind == "bpe":  # RoBERTa style: byte-level BPE, <s> ... </s></s> ... </s>
        special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=special)
        tokenizer.train_from_iterator(glue_sentences(), trainer)
        tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        tokens = {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
        tokens.update(pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:  # BERT style: WordPiece, [CLS] a [SEP] b [SEP] with segment ids
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=special)
        tokenizer.train_from_iterator(glue_sentences(), trainer)
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
        )
        tokens = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
        tokens["mask_token"] = "[MASK]"
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_input_names=names, model_max_length=256, **tokens
    )


def build_family(family: str, folder: Path) -> Path:
    """Save a tiny random model of `family` (with its masked-LM head) and its tokenizer."""
    make_config, kind, with_token_types = FAMILIES[family]
    tokenizer = train_tokenizer(kind, with_token_types)
    model = AutoModelForMaskedLM.from_config(make_config(len(tokenizer)))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_bert(folder: Path) -> Path:
    """The tiny random BERT of the recipe tests: a sequence classifier (2 labels; hidden 32,
    5 layers, 4 heads) with bert-base-uncased's real tokenizer from the repository's data/.
    Not a tokenizer trained here: the WordPiece trainer breaks ties in hash order, so two
    sessions would get different vocabularies: every session builds the same model, token ids
    and seeded weights alike."""
    tokenizer = AutoTokenizer.from_pretrained(BERT_BASE_CONFIG, model_max_length=512)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        intermediate_size=37,
        type_vocab_size=16,
        num_labels=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the session header
    model.save_pretrained(folder)
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    return folder
