//! Chat template tests: the Jinja renderer's HF helpers and refusals, load
//! errors, `--chat-template` files, one BOS per chat prompt, the fallbacks,
//! `--served-model-name`, and `--model DIR`.

mod common;

use std::path::Path;

use rngd_engine::EngineError;
use rngd_engine::chat_template::{ChatTemplate, SpecialTokens};
use rngd_engine::tokenizer::{PreTokenizer, Tokenizer, TokenizerOverrides, TokenizerParts};

fn specials() -> SpecialTokens {
    SpecialTokens {
        bos: Some("<s>".into()),
        eos: Some("</s>".into()),
    }
}

fn chat(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .collect()
}

fn render(source: &str, messages: &[(&str, &str)]) -> Result<String, EngineError> {
    ChatTemplate::compile(source, "test template", specials())?
        .render(&chat(messages), &Default::default())
}

#[test]
fn raise_exception_refuses_the_chat_with_its_message() {
    let t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok";
    assert_eq!(render(t, &[("user", "hi")]).unwrap(), "ok");
    match render(t, &[("system", "s"), ("user", "hi")]) {
        Err(EngineError::InvalidRequest(m)) => {
            assert!(
                m.contains("Conversations must start with a user message"),
                "{m}"
            )
        }
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
}

#[test]
fn load_errors_name_the_template_and_the_culprit() {
    for (source, needle) in [
        ("{{ messages | no_such_filter }}", "no_such_filter"),
        (
            "{% if messages is no_such_test %}x{% endif %}",
            "no_such_test",
        ),
        (
            "{% for m in messages %}{{ m.content | trim | shout }}{% endfor %}",
            "shout",
        ),
        ("{% for m in messages %}{{ m.content }}", "does not compile"),
    ] {
        let err = ChatTemplate::compile(source, "tokenizer.chat_template", specials())
            .expect_err(source)
            .to_string();
        assert!(err.contains("tokenizer.chat_template"), "{err}");
        assert!(err.contains(needle), "{source}: {err}");
    }
    // A filter name inside a string or a comment is not a use of it.
    render("{{ '| shout' }}{# x | shout #}", &[("user", "x")]).unwrap();
}

#[test]
fn hf_helpers_and_python_methods_work() {
    let t = "{% for m in messages %}\
             {% if m.role == 'skip' %}{% continue %}{% endif %}\
             {% if loop.index > 3 %}{% break %}{% endif %}\
             [{{ m.role.upper() }}|{{ m.content.strip() }}|{{ m.content.startswith(' a') }}|{{ m.content.split(',') | length }}]\
             {% endfor %}\
             {{ messages[0] | tojson }}|{{ {'k': [1, 2.5, none, true]} | tojson(indent=2) }}|{{ bos_token }}{{ eos_token }}|{{ add_generation_prompt }}";
    let out = render(
        t,
        &[
            ("user", " a,b "),
            ("skip", "x"),
            ("assistant", "c"),
            ("user", "d"),
            ("user", "never"),
        ],
    )
    .unwrap();
    // What jinja2 renders for the same template and chat: Python's `True`,
    // `loop.index` counting the skipped message, `json.dumps` spacing.
    assert_eq!(
        out,
        "[USER|a,b|True|2][ASSISTANT|c|False|1]\
         {\"role\": \"user\", \"content\": \" a,b \"}|{\n  \"k\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}|<s></s>|True"
    );
    let year: i32 = render("{{ strftime_now('%Y') }}", &[("user", "x")])
        .unwrap()
        .parse()
        .unwrap();
    assert!(year >= 2025, "{year}");
    assert!(render("{{ strftime_now('%Q') }}", &[("user", "x")]).is_err());
}

#[test]
fn blocks_are_trimmed_as_hf_renders_them() {
    // trim_blocks: the newline after a block tag goes; lstrip_blocks: the
    // indentation before one goes; the template's final newline goes.
    let t = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
    assert_eq!(
        render(t, &[("user", "a"), ("user", "b")]).unwrap(),
        "a\nb\n"
    );
}

#[test]
fn the_real_models_template_and_an_override_file() {
    let t = Tokenizer::from_gguf(&common::real_model()).unwrap();
    assert_eq!(t.template().kind(), "jinja");
    let multi = chat(&[
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Ünïcödé 🚀?"),
    ]);
    assert_eq!(
        t.chat_prompt(&multi, &Default::default()).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nÜnïcödé 🚀?<|im_end|>\n\
         <|im_start|>assistant\n"
    );

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    let o = TokenizerOverrides {
        chat_template: Some(file.clone()),
        served_model_name: Some("my-model".into()),
    };
    let t2 = t.clone().with_overrides(&o).unwrap();
    assert_eq!(t2.model_name(), "my-model");
    assert!(t2.template().origin().contains("t.jinja"));
    assert_eq!(
        t2.chat_prompt(&chat(&[("user", "Hi")]), &Default::default())
            .unwrap(),
        "<user>Hi<assistant>"
    );

    let missing = dir.path().join("missing.jinja");
    let err = t
        .clone()
        .with_chat_template_file(&missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.jinja"), "{err}");
    std::fs::write(&file, "{% if %}").unwrap();
    let err = t.clone().with_chat_template_file(&file).unwrap_err();
    assert!(err.to_string().contains("t.jinja"), "{err}");
    assert!(t.clone().with_model_name(" ").is_err());
}

/// GPT-2's printable character for each byte, in byte order.
fn gpt2_byte_chars() -> Vec<char> {
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let printable =
                (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            if printable {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// A byte-level vocabulary with `<s>`, `</s>` and `<|im_start|>` control tokens.
fn parts(add_bos: bool, template: Option<&str>, im_start: bool) -> TokenizerParts {
    let mut tokens: Vec<String> = gpt2_byte_chars().iter().map(|c| c.to_string()).collect();
    let bos = tokens.len() as u32;
    tokens.push("<s>".into());
    tokens.push("</s>".into());
    if im_start {
        tokens.push("<|im_start|>".into());
        tokens.push("<|im_end|>".into());
    }
    let mut token_types = vec![1; tokens.len()];
    for t in &mut token_types[bos as usize..] {
        *t = 3;
    }
    TokenizerParts {
        model_name: "bos-test".into(),
        tokens,
        merges: Vec::new(),
        pre: PreTokenizer::Gpt2,
        token_types,
        eos_token_id: Some(bos + 1),
        bos_token_id: Some(bos),
        add_bos,
        add_eos: false,
        chat_template: template.map(str::to_string),
    }
}

#[test]
fn a_chat_prompt_encodes_with_exactly_one_bos() {
    let template =
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    let bos = 256;
    for add_bos in [true, false] {
        let t = Tokenizer::from_parts(parts(add_bos, Some(template), false)).unwrap();
        let prompt = t
            .chat_prompt(&chat(&[("user", "hi")]), &Default::default())
            .unwrap();
        assert_eq!(
            prompt.starts_with("<s>"),
            !add_bos,
            "add_bos={add_bos}: {prompt:?}"
        );
        let ids = t.encode(&prompt).unwrap();
        assert_eq!(ids[0], bos, "add_bos={add_bos}");
        assert_eq!(
            ids.iter().filter(|&&i| i == bos).count(),
            1,
            "add_bos={add_bos}: {ids:?}"
        );
        // The template's own output keeps its BOS text either way.
        assert!(
            t.template()
                .render(&chat(&[("user", "hi")]), &Default::default())
                .unwrap()
                .starts_with("<s>")
        );
    }
}

#[test]
fn models_without_a_template_fall_back_to_chatml_or_plain_lines() {
    let msgs = chat(&[("system", "S"), ("user", "U")]);
    let chatml = Tokenizer::from_parts(parts(false, None, true)).unwrap();
    assert_eq!(chatml.template().kind(), "chatml");
    assert_eq!(
        chatml.chat_prompt(&msgs, &Default::default()).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    );
    let plain = Tokenizer::from_parts(parts(false, None, false)).unwrap();
    assert_eq!(plain.template().kind(), "plain");
    assert_eq!(
        plain.chat_prompt(&msgs, &Default::default()).unwrap(),
        "system: S\nuser: U\nassistant: "
    );
    assert!(plain.chat_prompt(&[], &Default::default()).is_err());
}

#[test]
fn a_model_directory_stands_for_its_one_gguf() {
    let real = common::real_model();
    let dir = tempfile::tempdir().unwrap();
    let resolve = |p: &Path| rngd_engine::model_fetch::resolve(Some(p));
    let err = resolve(dir.path()).unwrap_err().to_string();
    assert!(err.contains("no .gguf"), "{err}");
    std::fs::write(dir.path().join("README.md"), "not a model").unwrap();
    let one = dir.path().join("model-a.gguf");
    std::os::unix::fs::symlink(&real, &one).unwrap();
    assert_eq!(resolve(dir.path()).unwrap(), one);
    Tokenizer::from_gguf(&resolve(dir.path()).unwrap()).unwrap();
    std::os::unix::fs::symlink(&real, dir.path().join("model-b.GGUF")).unwrap();
    let err = resolve(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("2 .gguf files")
            && err.contains("model-a.gguf")
            && err.contains("model-b.GGUF"),
        "{err}"
    );
}

/// vLLM's template options: `add_generation_prompt` and
/// `chat_template_kwargs` reach the Jinja template as variables,
/// `continue_final_message` leaves the last message open, for the compiled
/// template and both fallbacks.
#[test]
fn template_options_reach_the_template() {
    use rngd_api::chat::TemplateOptions;
    let src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}\
               {% if add_generation_prompt %}<assistant>{% endif %}\
               {% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}";
    let t = ChatTemplate::compile(src, "test template", specials()).unwrap();
    let msgs = chat(&[("user", "hi"), ("assistant", "Once upon a")]);
    let on = TemplateOptions::default();
    assert_eq!(
        t.render(&msgs, &on).unwrap(),
        "<user>hi</user><assistant>Once upon a</assistant><assistant>"
    );
    let off = TemplateOptions {
        add_generation_prompt: false,
        ..TemplateOptions::default()
    };
    assert_eq!(
        t.render(&msgs, &off).unwrap(),
        "<user>hi</user><assistant>Once upon a</assistant>"
    );
    let open = TemplateOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..TemplateOptions::default()
    };
    assert_eq!(
        t.render(&msgs, &open).unwrap(),
        "<user>hi</user><assistant>Once upon a"
    );
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
    let thinking = TemplateOptions {
        kwargs,
        ..TemplateOptions::default()
    };
    assert!(
        t.render(&msgs, &thinking)
            .unwrap()
            .ends_with("<assistant><no_think>")
    );
    // A template that drops the final message cannot continue it.
    let drops = ChatTemplate::compile("{{ messages[0].content }}", "t", specials()).unwrap();
    assert!(matches!(
        drops.render(&msgs, &open),
        Err(EngineError::InvalidRequest(m)) if m.contains("continue_final_message")
    ));
    // The fallbacks honour both switches too.
    let chatml = Tokenizer::from_parts(parts(false, None, true)).unwrap();
    assert_eq!(
        chatml.chat_prompt(&msgs, &off).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon a<|im_end|>\n"
    );
    assert_eq!(
        chatml.chat_prompt(&msgs, &open).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon a"
    );
    let plain = Tokenizer::from_parts(parts(false, None, false)).unwrap();
    assert_eq!(
        plain.chat_prompt(&msgs, &off).unwrap(),
        "user: hi\nassistant: Once upon a\n"
    );
}
