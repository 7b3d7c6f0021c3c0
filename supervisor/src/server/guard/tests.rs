use super::*;

fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        map.insert(k.clone(), v.parse().unwrap());
    }
    map
}

fn loopback() -> Guard {
    Guard::new(
        &Listen::parse("127.0.0.1:7733").unwrap(),
        Vec::new(),
        &[],
        &["https://app.example".into()],
    )
}

#[test]
fn a_rebound_host_or_foreign_origin_is_refused_on_loopback() {
    let guard = loopback();
    let json = (header::CONTENT_TYPE, "application/json");
    let ok = headers(&[(header::HOST, "localhost:7733"), json.clone()]);
    assert!(guard.refuse(&Method::POST, "/v1/embeddings", &ok).is_none());
    let rebound = headers(&[(header::HOST, "evil.example:7733"), json.clone()]);
    let refused = guard.refuse(&Method::GET, "/api/ps", &rebound).unwrap();
    assert_eq!(refused.code, "forbidden_host");
    assert!(guard.refuse(&Method::GET, "/healthz", &rebound).is_none());
    let page = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::ORIGIN, "https://evil.example"),
        json.clone(),
    ]);
    assert_eq!(
        guard
            .refuse(&Method::POST, "/api/models/x/load", &page)
            .unwrap()
            .code,
        "forbidden_origin"
    );
    let allowed = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::ORIGIN, "https://app.example"),
        json,
    ]);
    assert!(
        guard
            .refuse(&Method::POST, "/v1/embeddings", &allowed)
            .is_none()
    );
}

#[test]
fn public_metrics_pass_without_token_or_host_and_nothing_else_does() {
    let guarded = Guard::new(
        &Listen::parse("0.0.0.0:7733").unwrap(),
        vec!["secret".into()],
        &["berth.example:7733".into()],
        &[],
    );
    let scrape = headers(&[(header::HOST, "10.1.2.3:7733")]);
    for guard in [guarded.clone(), guarded.clone().public_metrics(false)] {
        let refused = guard.refuse(&Method::GET, "/metrics", &scrape).unwrap();
        assert_eq!(refused.code, "forbidden_host");
    }
    let open = guarded.public_metrics(true);
    assert!(open.refuse(&Method::GET, "/metrics", &scrape).is_none());
    assert!(open.refuse(&Method::HEAD, "/metrics", &scrape).is_none());
    // Only the metrics: everything else still asks for Host and token.
    for path in ["/api/ps", "/v1/models", "/metrics/x", "/api/events"] {
        assert!(open.refuse(&Method::GET, path, &scrape).is_some(), "{path}");
    }
    let named = headers(&[(header::HOST, "berth.example:7733")]);
    let refused = open.refuse(&Method::GET, "/api/ps", &named).unwrap();
    assert_eq!(refused.code, "unauthorized");
    let posted = open.refuse(&Method::POST, "/metrics", &named).unwrap();
    assert_eq!(posted.code, "unauthorized");
    // On loopback the Host check stays (a rebound page's Host fails
    // it); the token is not asked for.
    let local = Guard::new(
        &Listen::parse("127.0.0.1:7733").unwrap(),
        vec!["secret".into()],
        &[],
        &[],
    )
    .public_metrics(true);
    let rebound = headers(&[(header::HOST, "evil.example:7733")]);
    let refused = local.refuse(&Method::GET, "/metrics", &rebound).unwrap();
    assert_eq!(refused.code, "forbidden_host");
    let own = headers(&[(header::HOST, "127.0.0.1:7733")]);
    assert!(local.refuse(&Method::GET, "/metrics", &own).is_none());
}

#[test]
fn a_post_must_be_json() {
    let guard = loopback();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let h = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_LENGTH, "5"),
        ]);
        assert_eq!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &h)
                .unwrap()
                .code,
            "unsupported_media_type",
            "{content_type}"
        );
    }
    // A body with no type, or with a type and length but not JSON.
    let untyped = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::CONTENT_LENGTH, "2"),
    ]);
    assert!(
        guard
            .refuse(&Method::POST, "/api/models/x/load", &untyped)
            .is_some()
    );
    let chunked = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::TRANSFER_ENCODING, "chunked"),
    ]);
    assert!(
        guard
            .refuse(&Method::POST, "/api/models/x/load", &chunked)
            .is_some()
    );
    // No body at all: nothing to type.
    for none in [
        headers(&[(header::HOST, "127.0.0.1:7733")]),
        headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::CONTENT_LENGTH, "0"),
        ]),
    ] {
        assert!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &none)
                .is_none()
        );
    }
    // ... but a foreign origin is still refused.
    let page = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::ORIGIN, "https://evil.example"),
    ]);
    assert_eq!(
        guard
            .refuse(&Method::POST, "/api/models/x/load", &page)
            .unwrap()
            .code,
        "forbidden_origin"
    );
    // Bytes go only where a route takes them.
    let bytes = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::CONTENT_TYPE, "application/octet-stream"),
        (header::CONTENT_LENGTH, "4"),
    ]);
    assert!(
        guard
            .refuse(&Method::POST, "/api/models/x/infer", &bytes)
            .is_none()
    );
    assert!(
        guard
            .refuse(&Method::POST, "/api/models/x/load", &bytes)
            .is_some()
    );
    let charset = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::CONTENT_TYPE, "Application/JSON; charset=utf-8"),
    ]);
    assert!(
        guard
            .refuse(&Method::POST, "/v1/embeddings", &charset)
            .is_none()
    );
}

#[test]
fn another_sites_page_is_refused_without_an_origin() {
    let guard = Guard::new(
        &Listen::parse("127.0.0.1:7733").unwrap(),
        Vec::new(),
        &[],
        &[],
    );
    let from = |site: &str| {
        headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::HeaderName::from_static("sec-fetch-site"), site),
        ])
    };
    for site in ["cross-site", "same-site"] {
        let refused = guard.refuse(&Method::GET, "/unload", &from(site));
        assert_eq!(
            refused.map(|e| e.code),
            Some("forbidden_origin".into()),
            "{site}"
        );
    }
    for site in ["same-origin", "none"] {
        assert!(
            guard.refuse(&Method::GET, "/unload", &from(site)).is_none(),
            "{site}"
        );
    }
    // The console's page may be opened from a link.
    assert!(
        guard
            .refuse(&Method::GET, "/", &from("cross-site"))
            .is_none()
    );
}

#[test]
fn a_token_passes_as_bearer_x_api_key_or_basic_password_and_only_exact() {
    let given = |pairs: &[(&str, &str)]| {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        presented(&map).iter().any(|g| same(g, "s3cret"))
    };
    let basic = format!("Basic {}", super::super::base64::encode(b"user:s3cret"));
    for ok in [
        vec![("authorization", "Bearer s3cret")],
        vec![("authorization", "bearer s3cret")],
        vec![("authorization", "BEARER  s3cret ")],
        vec![("x-api-key", "s3cret")],
        vec![("authorization", basic.as_str())],
        vec![("authorization", "Bearer wrong"), ("x-api-key", "s3cret")],
    ] {
        assert!(given(&ok), "{ok:?}");
    }
    for bad in [
        vec![("authorization", "Bearer s3cre")],
        vec![("authorization", "Basic s3cret")],
        vec![("authorization", "s3cret")],
        vec![],
    ] {
        assert!(!given(&bad), "{bad:?}");
    }
}

#[test]
fn the_consoles_own_origin_passes_where_the_host_was_checked_and_its_files_need_no_token() {
    let json = (header::CONTENT_TYPE, "application/json");
    let own = headers(&[
        (header::HOST, "127.0.0.1:7733"),
        (header::ORIGIN, "http://127.0.0.1:7733"),
        json.clone(),
    ]);
    assert!(
        loopback()
            .refuse(&Method::POST, "/api/models/x/load", &own)
            .is_none()
    );
    // On a private address with no Host list and no token, a rebound
    // page's origin matches its own Host: not taken as the console's.
    let lan = Guard::new(
        &Listen::parse("10.0.0.5:7733").unwrap(),
        Vec::new(),
        &[],
        &[],
    );
    let rebound = headers(&[
        (header::HOST, "evil.example:7733"),
        (header::ORIGIN, "http://evil.example:7733"),
        json.clone(),
    ]);
    let refused = lan
        .refuse(&Method::POST, "/api/models/x/load", &rebound)
        .unwrap();
    assert_eq!(refused.code, "forbidden_origin");
    // With a token: the page, its script and style load without it;
    // nothing else does.
    let guarded = Guard::new(
        &Listen::parse("127.0.0.1:7733").unwrap(),
        vec!["s3cret".into()],
        &[],
        &[],
    );
    let host = headers(&[(header::HOST, "127.0.0.1:7733")]);
    for path in ["/", "/console.js", "/console.css"] {
        assert!(
            guarded.refuse(&Method::GET, path, &host).is_none(),
            "{path}"
        );
    }
    for (method, path) in [
        (Method::GET, "/api/ps"),
        (Method::POST, "/"),
        (Method::GET, "/api/events"),
    ] {
        let refused = guarded.refuse(&method, path, &host).unwrap();
        assert_eq!(refused.code, "unauthorized", "{method} {path}");
    }
}
