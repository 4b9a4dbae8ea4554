"""A model named by its HuggingFace hub id (cullama/model/hub.py), on a hub cache laid out in a temporary folder
(tests/hub_cache.py) and read by huggingface_hub's own code, offline: the directory wins, the cache is found by
branch, tag and commit id, what is downloaded and what never is, and every way it cannot be had is one line."""

from __future__ import annotations

import sys

import pytest

import cullama
from cullama.common.errors import ConfigError, OptionError, ResourceError
from cullama.model import hub
from tests.hub_cache import MAIN, OLD, REPO, stories_cache

huggingface_hub = pytest.importorskip("huggingface_hub", reason="the hub extra is not installed (pip install -e "
                                                                "'.[test]')")
from huggingface_hub import constants, errors, utils  # noqa: E402


@pytest.fixture
def cache(tmp_path, stories_dir, monkeypatch):
    """The fake cache as huggingface_hub's cache (HF_HUB_CACHE), offline (HF_HUB_OFFLINE=1): its snapshots."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return stories_cache(tmp_path / "hub", stories_dir)


def test_a_hub_id_loads_from_the_cache_and_generates(cache, stories_expected):
    llm = cullama.Llama.from_pretrained(REPO, device="cpu")
    out = llm.generate([1], max_new_tokens=20)
    assert out.token_ids == stories_expected["ids"][:20] and llm.runner.max_seq_len == 512
    assert hub.resolve(REPO) == cache["main"]


@pytest.mark.parametrize("revision,snapshot", [("main", "main"), (MAIN, "main"), ("v0", "v0"), (OLD, "v0")])
def test_a_revision_is_a_branch_a_tag_or_a_commit(cache, revision, snapshot):
    assert hub.resolve(REPO, revision) == cache[snapshot]


def test_the_revision_decides_what_loads(cache):
    assert cullama.Llama.from_pretrained(REPO, device="cpu", revision="v0").runner.max_seq_len == 64


def test_a_directory_wins_over_a_hub_id(cache, stories_dir, tmp_path, monkeypatch):
    local = tmp_path / "karpathy" / "stories260K"
    local.parent.mkdir()
    local.symlink_to(stories_dir)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve(REPO) == hub.Path(REPO)  # the relative directory, not the cache's snapshot
    with pytest.raises(OptionError, match="revision is for a HuggingFace hub id, and \"karpathy/stories260K\" is a "
                                          "local path"):
        cullama.Llama.from_pretrained(REPO, device="cpu", revision="main")


@pytest.mark.parametrize("name,revision,needle", [
    ("karpathy/missing", None, "karpathy/missing is not a local directory, nor in the hub cache .*, and "
                               "HF_HUB_OFFLINE is set: download it first"),
    (REPO, "v9", 'karpathy/stories260K \\(revision "v9"\\) is not a local directory, nor in the hub cache'),
])
def test_what_is_not_in_the_cache_offline_is_one_line(cache, name, revision, needle):
    with pytest.raises(hub.HubError, match=needle) as info:
        cullama.Llama.from_pretrained(name, device="cpu", revision=revision)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_an_incomplete_snapshot_offline_is_one_line(cache):
    # huggingface_hub >= 1.x records the repo's file list when it downloads: a listed file that is missing is named
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache", reason="this huggingface_hub keeps no file list")
    listed = ("config.json", "model.safetensors", "tokenizer.json", "original/params.json")
    tree_cache.write_tree_cache(str(cache["main"].parents[1]), MAIN,
                                {p: tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40) for p in listed})
    with pytest.raises(hub.HubError, match=r"karpathy/stories260K: The cached snapshot for 'karpathy/stories260K' "
                                           r"\(revision 'main', commit 0123.*\) is incomplete: 1 file\(s\) are "
                                           r"missing \(tokenizer.json\)\. The hub cannot be reached now") as info:
        hub.resolve(REPO)  # original/params.json is missing too, but it is never asked for
    assert "\n" not in str(info.value)


def failing(error):
    """A snapshot_download that raises `error` (an instance made without its HTTP response)."""
    def download(*args, **kwargs):
        raise error
    return download


def made(cls, message="x"):
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize("error,kind,needle", [
    ("GatedRepoError", hub.HubError, "is a gated repo on the HuggingFace hub: accept its terms at "
                                     "https://huggingface.co/org/model, then log in"),
    ("RepositoryNotFoundError", hub.HubError, "org/model is neither a local directory nor a model repo on the "
                                              "HuggingFace hub \\(or it is private"),
    ("RevisionNotFoundError", hub.HubError, 'org/model has no revision "v2" on the HuggingFace hub'),
    ("LocalEntryNotFoundError", ResourceError, "the HuggingFace hub cannot be reached: check the network"),
    ("HfHubHTTPError", ResourceError, "the HuggingFace hub answered 500 Server Error"),
])
def test_what_the_hub_answers_is_one_line(monkeypatch, error, kind, needle):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: the network is down
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        failing(made(getattr(errors, error), "500 Server Error\nfor url")))
    with pytest.raises(kind, match=needle) as info:
        hub.resolve("org/model", "v2")
    assert "\n" not in str(info.value)


def test_only_what_cullama_reads_is_asked_for(monkeypatch, tmp_path):
    asked = {}

    def download(repo_id, **kwargs):
        asked.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert hub.resolve("meta-llama/Llama-3.1-8B-Instruct", "main") == tmp_path
    assert asked["repo_id"] == "meta-llama/Llama-3.1-8B-Instruct" and asked["revision"] == "main"
    # a LLaMA-3 repo as the hub lists it (Meta's own weights in original/), and a Mistral one's extras
    listing = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
               "model-00004-of-00004.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "LICENSE",
               "README.md", "USE_POLICY.md", "original/consolidated.00.pth", "original/params.json",
               "original/tokenizer.model", "consolidated.safetensors", "params.json", "pytorch_model.bin",
               "onnx/model.onnx_data", "onnx/config.json", "quantize_config.json"]
    wanted = list(utils.filter_repo_objects(listing, allow_patterns=asked["allow_patterns"],
                                                             ignore_patterns=asked["ignore_patterns"]))
    assert wanted == ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
                      "model-00004-of-00004.safetensors", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model",
                      "params.json", "quantize_config.json"]
    hub.resolve("org/tok", files=hub.TOKENIZER_FILES, what="tokenizer")
    assert list(utils.filter_repo_objects(listing, allow_patterns=asked["allow_patterns"],
                                                          ignore_patterns=asked["ignore_patterns"])) == \
        ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "tokenizer.model"]


def test_without_huggingface_hub_a_hub_id_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError
    with pytest.raises(hub.HubError, match=r"org/model is not a local directory; read as a HuggingFace hub id, it "
                                           r"needs the hub extra \(pip install 'cullama\[hub\]'\)"):
        cullama.Llama.from_pretrained("org/model", device="cpu")


def test_a_path_that_is_no_repo_id_keeps_the_directory_error(tmp_path):
    for name in (str(tmp_path / "nothing"), "./nothing", "a/b/c", "~/nothing", "../x"):
        with pytest.raises(ConfigError, match="no such model directory"):
            cullama.Llama.from_pretrained(name, device="cpu")


@pytest.mark.parametrize("name", ["karpathy/stories260K", "stories260K", "a/b/c", "../x", "org/na me", "-org/x",
                                  "org/x-", "org--x/y", "x.git", "./x", "/abs/path", "org/", "/x", "a..b", "o/.x",
                                  "meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-0.5B-Instruct", "x" * 97, "x" * 96])
def test_a_repo_id_is_what_huggingface_hub_takes(name):
    try:
        utils.validate_repo_id(name)
        valid = True
    except errors.HFValidationError:
        valid = False
    assert hub.is_repo_id(name) == valid


def test_a_revision_must_be_text():
    for bad in ("", " ", 3):
        with pytest.raises(OptionError, match="revision must be a branch, a tag or a commit id"):
            hub.resolve("org/model", bad)
