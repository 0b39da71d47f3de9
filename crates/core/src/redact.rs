//! Hiding credentials in what is shown of a configured server: errors and logs (which reach the
//! LLM, the client and the graph) and the config API's answers to readers without its token.

/// Whether `text` (an argument, a flag, a variable's name) names a credential.
pub fn names_secret(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    [
        "token",
        "key",
        "secret",
        "password",
        "passwd",
        "auth",
        "credential",
    ]
    .iter()
    .any(|word| lower.contains(word))
}

/// `url` without its user information, query and fragment. Everything up to the last `@` after
/// the scheme goes (a password may hold an unencoded `?` or `/`), at the cost of a path with an
/// `@` in it losing its host: shown too little, never a password. What is left ends at the first
/// `?`, `#`, `&`, `;` or `=`: an `@` in the query (`?user=ops@example.com&api_key=...`) left the
/// rest of the query standing where the host was.
///
/// ```
/// use agent_core::redact::without_credentials;
/// assert_eq!(without_credentials("https://u:pw@h:1/p?key=k#f"), "https://h:1/p");
/// assert_eq!(without_credentials("postgres://u:p?x/y@db/app"), "postgres://db/app");
/// assert_eq!(without_credentials("https://h/mcp"), "https://h/mcp");
/// assert_eq!(
///     without_credentials("https://h/sse?user=ops@example.com&api_key=sk-1"),
///     "https://example.com"
/// );
/// ```
pub fn without_credentials(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let rest = &rest[..rest.find(['?', '#', '&', ';', '=']).unwrap_or(rest.len())];
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest.to_owned(),
    }
}

/// What is shown of a stdio server's arguments: an argument that names a secret, or follows a
/// flag that does, is `***`; `NAME=value` whose name or value does keeps the name; a URL (alone,
/// or as a value) loses its credentials, query and fragment.
///
/// ```
/// use agent_core::redact::shown_arguments;
/// let args = ["--token", "t0k", "--api-key=k", "pkg", "SECRET_X", "pg://u:p@db/x", "--v"];
/// assert_eq!(
///     shown_arguments(&args.map(String::from)),
///     ["--token", "***", "--api-key=***", "pkg", "***", "pg://db/x", "--v"]
/// );
/// // A URL whose query has an `=` is a URL, not a flag; a value may name the secret.
/// let args = [
///     "mongodb://app:pw@db/x?authSource=admin",
///     "--header=Authorization: Bearer sk-1",
///     "--env=GITHUB_TOKEN=ghp_1",
///     "--url=https://u:pw@h/sse?k=v",
/// ];
/// assert_eq!(
///     shown_arguments(&args.map(String::from)),
///     ["mongodb://db/x", "--header=***", "--env=***", "--url=https://h/sse"]
/// );
/// ```
pub fn shown_arguments(args: &[String]) -> Vec<String> {
    let mut after_secret_flag = false;
    args.iter()
        .map(|arg| {
            let secret = names_secret(arg);
            // `flag=value`, unless the `=` is inside a URL's query.
            let flag_value = arg
                .split_once('=')
                .filter(|(flag, _)| !flag.contains("://"));
            let shown = match flag_value {
                _ if after_secret_flag => "***".to_owned(),
                Some((flag, value)) if names_secret(flag) || names_secret(value) => {
                    format!("{flag}=***")
                }
                Some((flag, value)) if value.contains("://") => {
                    format!("{flag}={}", shown_url(value))
                }
                Some(_) => arg.clone(),
                None if arg.contains("://") => shown_url(arg),
                None if secret && !arg.starts_with('-') => "***".to_owned(),
                None => arg.clone(),
            };
            after_secret_flag =
                !after_secret_flag && secret && arg.starts_with('-') && !arg.contains('=');
            shown
        })
        .collect()
}

/// A URL without its credentials (see [`without_credentials`]), or `***` when what is left still
/// names a secret (a token in its path: `https://h/token/abc`).
fn shown_url(url: &str) -> String {
    let shown = without_credentials(url);
    if names_secret(&shown) {
        "***".to_owned()
    } else {
        shown
    }
}
