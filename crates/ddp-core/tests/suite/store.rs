//! TCP store: semantics, blocking, timeouts, run token, size limits, prefix views, bind errors (127.0.0.1 only).

use ddp_core::store::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use ddp_core::{DdpError, PrefixStore, RunToken, Store, TcpStore, TcpStoreServer};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Generous: waits that should succeed must survive a loaded 2-core machine.
const LONG: Duration = Duration::from_secs(60);

fn server() -> (TcpStoreServer, RunToken) {
    let token = RunToken::generate().unwrap();
    (TcpStoreServer::bind("127.0.0.1:0", token).unwrap(), token)
}

fn client(server: &TcpStoreServer, token: RunToken, timeout: Duration) -> TcpStore {
    TcpStore::connect(&server.local_addr().to_string(), token, timeout).unwrap()
}

#[test]
fn every_operation_has_the_documented_semantics() {
    let (server, token) = server();
    let s = client(&server, token, LONG);

    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a").unwrap(), b"1");
    s.set("a", b"two").unwrap();
    assert_eq!(s.get("a").unwrap(), b"two");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty").unwrap(), b"");

    // add: ASCII decimal, missing key counts as 0, returns the new value.
    assert_eq!(s.add("counter", 5).unwrap(), 5);
    assert_eq!(s.add("counter", -2).unwrap(), 3);
    assert_eq!(s.get("counter").unwrap(), b"3");
    let err = s.add("a", 1).unwrap_err();
    assert!(matches!(err, DdpError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("\"a\""), "{err}");

    // compare_set: missing key matches empty `expected`; returns the value after the call.
    assert_eq!(s.compare_set("cas", b"", b"x").unwrap(), b"x");
    assert_eq!(s.compare_set("cas", b"nope", b"y").unwrap(), b"x");
    assert_eq!(s.compare_set("cas", b"x", b"y").unwrap(), b"y");
    assert_eq!(s.compare_set("missing", b"something", b"z").unwrap(), b"");
    assert!(!s.check(&["missing"]).unwrap());

    // check / wait / delete / num_keys.
    assert!(s.check(&["a", "counter", "cas"]).unwrap());
    assert!(!s.check(&["a", "absent"]).unwrap());
    assert!(s.check(&[]).unwrap());
    s.wait(&["a", "cas"], LONG).unwrap();
    assert_eq!(s.num_keys().unwrap(), 4); // a, empty, counter, cas
    assert_eq!(server.num_keys(), 4);
    assert!(s.delete_key("a").unwrap());
    assert!(!s.delete_key("a").unwrap());
    assert_eq!(s.num_keys().unwrap(), 3);
    assert_eq!(s.timeout(), LONG);

    // Binary values survive unchanged.
    let blob: Vec<u8> = (0..=255u8).cycle().take(100_003).collect();
    s.set("blob", &blob).unwrap();
    assert_eq!(s.get("blob").unwrap(), blob);
}

#[test]
fn blocking_get_is_woken_by_a_later_set_from_another_client() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let waiter = std::thread::spawn(move || {
        let s = TcpStore::connect(&addr, token, LONG).unwrap();
        let v = s.get("late").unwrap();
        s.wait(&["late", "later"], LONG).unwrap();
        v
    });
    std::thread::sleep(Duration::from_millis(100));
    let setter = client(&server, token, LONG);
    setter.set("late", b"value").unwrap();
    setter.set("later", b"").unwrap();
    assert_eq!(waiter.join().unwrap(), b"value");
}

#[test]
fn a_thread_blocked_in_get_does_not_starve_other_threads_of_the_same_client() {
    let (server, token) = server();
    let s = Arc::new(client(&server, token, LONG));
    let s2 = s.clone();
    let blocked = std::thread::spawn(move || s2.get("go").unwrap());
    std::thread::sleep(Duration::from_millis(100));
    // Same client, other thread: these must complete while the get above is parked on the server.
    assert_eq!(s.add("n", 1).unwrap(), 1);
    s.set("go", b"now").unwrap();
    assert_eq!(blocked.join().unwrap(), b"now");
}

#[test]
fn get_and_wait_time_out_with_an_error_naming_the_key_and_the_time() {
    let (server, token) = server();
    let s = client(&server, token, LONG).with_timeout(Duration::from_millis(300));
    s.set("present", b"1").unwrap();
    match s.get("never-set-key") {
        Err(DdpError::StoreTimeout { keys, waited }) => {
            assert_eq!(keys, vec!["never-set-key".to_string()]);
            assert!(waited >= Duration::from_millis(300), "{waited:?}");
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    let err = s.wait(&["present", "absent-1", "absent-2"], Duration::from_millis(200)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("absent-1") && msg.contains("absent-2") && !msg.contains("present"), "{msg}");
    assert!(msg.contains("timed out after") && msg.contains(" s waiting"), "{msg}");
    match err {
        DdpError::StoreTimeout { waited, .. } => assert!(waited >= Duration::from_millis(200), "{waited:?}"),
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    // The connection is still usable after a timeout.
    assert_eq!(s.get("present").unwrap(), b"1");
}

#[test]
fn a_wrong_or_missing_run_token_is_refused() {
    let (server, _token) = server();
    let addr = server.local_addr().to_string();
    let wrong = RunToken::generate().unwrap();
    match TcpStore::connect(&addr, wrong, LONG) {
        Err(DdpError::TokenRejected { peer }) => assert_eq!(peer, addr),
        other => panic!("expected TokenRejected, got {other:?}"),
    }

    // A peer that skips the handshake gets nothing served: the server closes on it.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    raw.write_all(&[0u8; 24]).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "server must close a connection with a bad hello");
    assert_eq!(server.num_connections(), 0);

    // The wrong token is on record for a launcher to report (the client may return before the server has
    // checked its proof); the peer that is no store client at all is not.
    let deadline = std::time::Instant::now() + LONG;
    while server.refused_peers().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = server.refused_peers();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].reason, "run token mismatch");
    assert!(refused[0].peer.starts_with("127.0.0.1:"), "{refused:?}");
    // ... and under a key, for every rank waiting on this store.
    let s = client(&server, _token, LONG);
    let recorded = String::from_utf8(s.get(ddp_core::store::REFUSED_PEER_KEY).unwrap()).unwrap();
    assert_eq!(recorded, format!("{}: run token mismatch", refused[0].peer));
}

/// torchrun-style by hand: rank 0 hosts the store, rank 1 starts with another run token. Rank 1 is refused at
/// once; rank 0, forming the group, must fail at once too (naming the refusal), not wait for the timeout.
#[test]
fn a_rank_refused_by_the_store_fails_rank_0_at_once() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let wrong = RunToken::generate().unwrap();
    assert!(matches!(TcpStore::connect(&addr, wrong, LONG), Err(DdpError::TokenRejected { .. })));
    let store: std::sync::Arc<dyn ddp_core::Store> = std::sync::Arc::new(client(&server, token, LONG));
    let started = std::time::Instant::now();
    let opts = ddp_core::GroupOptions { timeout: Duration::from_secs(120), ..ddp_core::GroupOptions::default() };
    let err = ddp_core::ProcessGroup::from_store(store, 0, 2, opts).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(20), "waited {:?}", started.elapsed());
    assert!(err.contains("the store refused a peer") && err.contains("run token mismatch"), "{err}");
}

#[test]
fn oversized_keys_and_values_are_refused_on_both_sides() {
    let (server, token) = server();
    let s = client(&server, token, LONG);

    let big = vec![0u8; MAX_VALUE_BYTES + 1];
    let err = s.set("big", &big).unwrap_err();
    assert!(matches!(err, DdpError::Protocol(_)), "{err}");
    assert!(err.to_string().contains("MAX_VALUE_BYTES"), "{err}");
    let long_key = "k".repeat(MAX_KEY_BYTES + 1);
    let err = s.get(&long_key).unwrap_err();
    assert!(err.to_string().contains("MAX_KEY_BYTES"), "{err}");
    // Nothing was stored and the client still works.
    assert_eq!(s.num_keys().unwrap(), 0);
    let max_key = "k".repeat(MAX_KEY_BYTES);
    s.set(&max_key, b"ok").unwrap();
    assert_eq!(s.get(&max_key).unwrap(), b"ok");

    // Server side: a hand-written client that authenticates and then announces a 1 GiB frame gets an error
    // answer and a closed connection, and the server keeps serving others.
    let (mut raw, ok) = raw_handshake(&server.local_addr().to_string(), &token);
    assert_eq!(ok, Some(0), "handshake with the right token is accepted");
    raw.write_all(&(1u32 << 30).to_le_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("frame of 1073741824 bytes"), "{text:?}");
    assert_eq!(s.get(&max_key).unwrap(), b"ok");
}

#[test]
fn prefix_store_namespaces_keys() {
    let (server, token) = server();
    let base: Arc<dyn Store> = Arc::new(client(&server, token, LONG));
    let g1 = PrefixStore::new("group1", base.clone());
    let g2 = PrefixStore::new("group2", base.clone());
    g1.set("k", b"one").unwrap();
    g2.set("k", b"two").unwrap();
    assert_eq!(g1.get("k").unwrap(), b"one");
    assert_eq!(g2.get("k").unwrap(), b"two");
    assert_eq!(base.get("group1/k").unwrap(), b"one");
    assert_eq!(g1.add("n", 2).unwrap(), 2);
    assert_eq!(base.get("group1/n").unwrap(), b"2");
    assert!(g1.check(&["k", "n"]).unwrap());
    assert!(!g2.check(&["n"]).unwrap());
    assert_eq!(g2.compare_set("k", b"two", b"2").unwrap(), b"2");
    assert!(g1.delete_key("k").unwrap());
    assert!(base.check(&["group2/k"]).unwrap() && !base.check(&["group1/k"]).unwrap());
    assert_eq!(g1.num_keys().unwrap(), base.num_keys().unwrap());

    // Nested prefixes and errors naming the full key.
    let nested = PrefixStore::new("sub", Arc::new(g1.clone()));
    nested.set("x", b"1").unwrap();
    assert_eq!(base.get("group1/sub/x").unwrap(), b"1");
    let err = nested.wait(&["missing"], Duration::from_millis(100)).unwrap_err().to_string();
    assert!(err.contains("group1/sub/missing"), "{err}");
}

#[test]
fn binding_a_port_in_use_names_host_and_port() {
    let (server, token) = server();
    let addr = format!("127.0.0.1:{}", server.port());
    match TcpStoreServer::bind(&addr, token) {
        Err(e @ DdpError::Bind { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&addr), "{msg}");
            assert!(msg.contains("MASTER_PORT"), "{msg}");
        }
        other => panic!("expected a Bind error, got {other:?}"),
    }
}

#[test]
fn connect_retries_until_the_server_comes_up() {
    // Find a free port, release it, and bring a server up on it a little after the client starts connecting.
    let port = TcpStoreServer::bind("127.0.0.1:0", RunToken::generate().unwrap()).unwrap().port();
    let token = RunToken::generate().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let server = TcpStoreServer::bind(&format!("127.0.0.1:{port}"), token).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        server
    });
    let s = TcpStore::connect(&addr, token, LONG).unwrap();
    s.set("k", b"v").unwrap();
    assert_eq!(s.get("k").unwrap(), b"v");
    assert!(s.local_ip().is_loopback());
    let s2 = s.try_clone_connection().unwrap();
    assert_eq!(s2.get("k").unwrap(), b"v");
    drop(starter.join().unwrap());
}

#[test]
fn connect_gives_up_after_its_timeout_naming_the_address() {
    let port = TcpStoreServer::bind("127.0.0.1:0", RunToken::generate().unwrap()).unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let start = Instant::now();
    match TcpStore::connect(&addr, RunToken::generate().unwrap(), Duration::from_millis(300)) {
        Err(e @ DdpError::Connect { .. }) => {
            assert!(e.to_string().contains(&addr), "{e}");
        }
        other => panic!("expected a Connect error, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_millis(300));
}

#[test]
fn dropping_the_server_fails_blocked_and_later_calls_instead_of_hanging() {
    let (server, token) = server();
    let s = Arc::new(client(&server, token, LONG));
    let s2 = s.clone();
    let blocked = std::thread::spawn(move || s2.get("never"));
    std::thread::sleep(Duration::from_millis(100));
    drop(server);
    let err = blocked.join().unwrap().unwrap_err();
    assert!(!matches!(err, DdpError::StoreTimeout { .. }), "{err}");
    assert!(s.set("k", b"v").is_err());
}

#[test]
fn many_clients_count_together() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let s = TcpStore::connect(&addr, token, LONG).unwrap();
                for _ in 0..50 {
                    s.add("total", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client(&server, token, LONG).get("total").unwrap(), b"400");
}

// ---- The handshake (protocol version 2), written here from the documentation in store/protocol.rs. ----

const HELLO_OK: u8 = 0;
const HELLO_BAD_TOKEN: u8 = 1;

/// HMAC-SHA256 (RFC 2104) keyed with the token over `len(label) u32 LE || label || server nonce || client nonce`.
fn proof(token: &RunToken, label: &[u8], server_nonce: &[u8], client_nonce: &[u8]) -> Vec<u8> {
    use hmac::Mac;
    let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(token.as_bytes()).unwrap();
    m.update(&(label.len() as u32).to_le_bytes());
    m.update(label);
    m.update(server_nonce);
    m.update(client_nonce);
    m.finalize().into_bytes().to_vec()
}

fn hello(client_nonce: &[u8; 16]) -> Vec<u8> {
    let mut h = b"ACST".to_vec();
    h.extend_from_slice(&2u16.to_le_bytes());
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(client_nonce);
    h
}

/// A hand-written client: sends a hello, checks the server's proof (it must verify exactly when `token` is the
/// server's), sends its own proof and returns the stream and the server's final byte (`None`: closed).
fn raw_handshake(addr: &str, token: &RunToken) -> (TcpStream, Option<u8>) {
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    let client_nonce: [u8; 16] = std::array::from_fn(|i| (i as u8).wrapping_mul(37) ^ 0x5a);
    raw.write_all(&hello(&client_nonce)).unwrap();
    let mut challenge = [0u8; 5 + 16 + 32];
    raw.read_exact(&mut challenge).unwrap();
    assert_eq!(&challenge[..5], b"ACSS\x03", "server magic and the challenge status");
    let server_nonce = &challenge[5..21];
    let expected = proof(token, b"accel-store v2 server", server_nonce, &client_nonce);
    raw.write_all(&proof(token, b"accel-store v2 client", server_nonce, &client_nonce)).unwrap();
    let mut last = [0u8; 1];
    let answer = match raw.read(&mut last) {
        Ok(1) => Some(last[0]),
        _ => None,
    };
    assert_eq!(expected == challenge[21..], answer == Some(HELLO_OK), "server proof verifies iff we are accepted");
    (raw, answer)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A fake peer on 127.0.0.1 that records everything one connection sends it; `reply` decides what it answers
/// after the first 24 bytes (`None`: stay silent until the client goes away).
fn recording_peer(reply: Option<Vec<u8>>) -> (String, Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let t = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(LONG)).unwrap();
        let mut buf = [0u8; 4096];
        let mut replied = false;
        loop {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => record.lock().unwrap().extend_from_slice(&buf[..n]),
            }
            if !replied && record.lock().unwrap().len() >= 24 {
                replied = true;
                if let Some(r) = &reply {
                    let _ = conn.write_all(r);
                }
            }
        }
    });
    (addr, seen, t)
}

#[test]
fn the_run_token_never_goes_on_the_wire() {
    let token = RunToken::generate().unwrap();
    // A fake server that answers with a well-formed challenge (random nonce, random "proof"), so the client goes
    // all the way through the handshake: it must refuse the fake at once and still never send the token.
    let mut challenge = b"ACSS\x03".to_vec();
    challenge.extend_from_slice(RunToken::generate().unwrap().as_bytes());
    challenge.extend_from_slice(&[7u8; 32]);
    let (addr, seen, t) = recording_peer(Some(challenge));
    let start = Instant::now();
    let err = TcpStore::connect(&addr, token, LONG).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    assert!(matches!(err, DdpError::TokenRejected { .. }), "{err}");
    assert!(err.to_string().contains("run token mismatch"), "{err}");
    t.join().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 24 + 32, "hello then proof");
    assert_eq!(&seen[..8], b"ACST\x02\x00\x00\x00");
    assert!(!contains(&seen, token.as_bytes()), "token bytes on the wire");
    assert!(!contains(&seen, token.to_hex().as_bytes()), "token hex on the wire");
    assert!(!contains(&seen, token.to_hex().to_uppercase().as_bytes()), "token hex on the wire");
}

#[test]
fn a_wrong_token_fails_fast_on_both_sides() {
    let (server, token) = server();
    let addr = server.local_addr().to_string();
    let wrong = RunToken::generate().unwrap();

    // Client side: the library client, with a long connect timeout, fails at once.
    let start = Instant::now();
    let err = TcpStore::connect(&addr, wrong, LONG).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    assert!(err.to_string().contains("run token mismatch") && err.to_string().contains(&addr), "{err}");

    // Server side: a hand-written client with the wrong token is refused at once (no handshake timeout) and the
    // connection is closed; with the right token the same client is accepted.
    let start = Instant::now();
    let (mut raw, answer) = raw_handshake(&addr, &wrong);
    assert_eq!(answer, Some(HELLO_BAD_TOKEN));
    let mut rest = Vec::new();
    assert_eq!(raw.read_to_end(&mut rest).unwrap_or(0), 0, "closed after the refusal");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    assert_eq!(server.num_connections(), 0);
    let (_ok, answer) = raw_handshake(&addr, &token);
    assert_eq!(answer, Some(HELLO_OK));
}

#[test]
fn a_silent_peer_or_an_http_server_is_not_an_accel_store() {
    let token = RunToken::generate().unwrap();
    let connect_timeout = Duration::from_millis(500);

    let (addr, _seen, t) = recording_peer(None);
    let start = Instant::now();
    let err = TcpStore::connect(&addr, token, connect_timeout).unwrap_err();
    let took = start.elapsed();
    assert!(took >= connect_timeout - Duration::from_millis(50) && took < Duration::from_secs(5), "{took:?}");
    let msg = err.to_string();
    assert!(matches!(err, DdpError::Protocol(_)), "{msg}");
    assert!(msg.contains(&format!("the peer at {addr} is not an accel store")), "{msg}");
    assert!(msg.contains("answered nothing within") && msg.contains("MASTER_ADDR/MASTER_PORT"), "{msg}");
    t.join().unwrap();

    let page = format!("HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<html>{}</html>", "x".repeat(200));
    let (addr, seen, t) = recording_peer(Some(page.into_bytes()));
    let start = Instant::now();
    let err = TcpStore::connect(&addr, token, connect_timeout).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    let msg = err.to_string();
    assert!(msg.contains(&format!("the peer at {addr} is not an accel store")), "{msg}");
    // Escaped and truncated: the first 64 bytes, control characters written out, then "...".
    assert!(
        msg.contains(r#"it answered "HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<html>xxxxx"..."#),
        "{msg}"
    );
    assert!(
        !msg.contains('\r') && !msg.contains("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"),
        "{msg}"
    );
    assert!(msg.contains("no other job or service listens on that port"), "{msg}");
    t.join().unwrap();
    assert!(!contains(&seen.lock().unwrap(), token.as_bytes()));
}

#[test]
fn a_replayed_client_handshake_is_refused() {
    let (server, token) = server();
    // A recording relay between a genuine client and the server.
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay.local_addr().unwrap().to_string();
    let upstream = server.local_addr();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let record = recorded.clone();
    std::thread::spawn(move || {
        let (mut down, _) = relay.accept().unwrap();
        let mut up = TcpStream::connect(upstream).unwrap();
        let (mut down2, mut up2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut up2, &mut down2));
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = down.read(&mut buf) {
            record.lock().unwrap().extend_from_slice(&buf[..n]);
            if up.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    });
    let genuine = TcpStore::connect(&relay_addr, token, LONG).unwrap();
    genuine.set("k", b"v").unwrap();
    assert_eq!(genuine.get("k").unwrap(), b"v");
    let handshake = recorded.lock().unwrap()[..24 + 32].to_vec();
    assert!(!contains(&recorded.lock().unwrap(), token.as_bytes()));

    // Replay the genuine hello and proof on a fresh connection: the server's new nonce makes the proof stale.
    let start = Instant::now();
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.set_read_timeout(Some(LONG)).unwrap();
    raw.write_all(&handshake[..24]).unwrap();
    let mut challenge = [0u8; 53];
    raw.read_exact(&mut challenge).unwrap();
    raw.write_all(&handshake[24..]).unwrap();
    let mut answer = [0u8; 1];
    raw.read_exact(&mut answer).unwrap();
    assert_eq!(answer[0], HELLO_BAD_TOKEN);
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    let mut rest = Vec::new();
    assert_eq!(raw.read_to_end(&mut rest).unwrap_or(0), 0, "closed after the refusal");
    // Only the genuine client is connected.
    assert_eq!(server.num_connections(), 1);
}
