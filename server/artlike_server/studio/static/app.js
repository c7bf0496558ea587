// artlike studio: a client of the server's public HTTP API (docs/studio.md). Plain ES2020, no dependency,
// no build step. Everything that comes from the API (model output, prompts, comments, metadata) is put in
// the page as text (textContent / text nodes), never as HTML.
'use strict';

(() => {
  // ------------------------------------------------------------------------------------------ helpers
  const $ = (sel, root = document) => root.querySelector(sel);
  const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));
  const SVG_NS = 'http://www.w3.org/2000/svg';

  /** An element: `attrs` are attributes (on* functions become listeners), children strings become text. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    appendAll(el, children);
    return el;
  }

  /** An SVG element, same rules as h(). */
  function s(tag, attrs, ...children) {
    const el = document.createElementNS(SVG_NS, tag);
    setAttrs(el, attrs);
    appendAll(el, children);
    return el;
  }

  const PROPS = new Set(['value', 'checked', 'disabled', 'hidden', 'selected', 'tabIndex']);

  function setAttrs(el, attrs) {
    if (!attrs) return;
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === 'text') el.textContent = String(value);
      else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
      else if (key === 'style' && typeof value === 'object') Object.assign(el.style, value);
      else if (PROPS.has(key)) el[key] = value;
      else el.setAttribute(key, value === true ? '' : String(value));
    }
  }

  function appendAll(el, children) {
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  function clear(el) {
    while (el.firstChild) el.removeChild(el.firstChild);
    return el;
  }

  /** The focused element under `root` and its caret, to give back after a redraw (null: the focus is elsewhere). */
  function focusWithin(root) {
    const el = document.activeElement;
    if (!el || el === document.body || !root.contains(el)) return null;
    const item = el.closest('[data-completion-id]');
    const saved = { el, completionId: item ? item.dataset.completionId : null, comment: el.matches('input.comment') };
    if (typeof el.selectionStart === 'number') {
      saved.selection = [el.selectionStart, el.selectionEnd, el.selectionDirection];
    }
    return saved;
  }

  function restoreFocus(root, saved) {
    if (!saved || document.activeElement === saved.el) return;
    let el = saved.el.isConnected ? saved.el : null;
    if (!el && saved.comment && saved.completionId !== null) {  // replaced: the new box of the same completion
      el = $(`[data-completion-id="${CSS.escape(saved.completionId)}"] input.comment`, root);
    }
    if (!el) return;
    el.focus({ preventScroll: true });
    if (saved.selection && typeof el.setSelectionRange === 'function') {
      try { el.setSelectionRange(...saved.selection); } catch (_) { /* not a text input */ }
    }
  }

  /**
   * Make `nodes` the children of `root`, moving only what is out of place. Removing or moving a focused
   * element blurs it: a comment being typed when a redraw lands would lose the keys typed next (they go to
   * the page, where they are rating keys). An element that stays keeps its place, and the focus and caret
   * are given back if a move took them anyway.
   */
  function drawChildren(root, nodes) {
    const saved = focusWithin(root);
    const wanted = new Set(nodes);
    Array.from(root.childNodes).forEach((node) => { if (!wanted.has(node)) node.remove(); });
    nodes.forEach((node, i) => {
      const at = root.childNodes[i];
      if (at !== node) root.insertBefore(node, at || null);
    });
    restoreFocus(root, saved);
  }

  function qs(query) {
    if (!query) return '';
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value === undefined || value === null || value === '') continue;
      params.append(key, String(value));
    }
    const text = params.toString();
    return text ? `?${text}` : '';
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  function randomHex(bytes) {
    const buf = new Uint8Array(bytes);
    crypto.getRandomValues(buf);
    return Array.from(buf, (b) => b.toString(16).padStart(2, '0')).join('');
  }

  function fmtNum(value, digits = 4) {
    if (value === null || value === undefined || typeof value !== 'number' || !Number.isFinite(value)) return '—';
    if (value !== 0 && Math.abs(value) >= 10 ** digits) return value.toFixed(0);
    if (value !== 0 && Math.abs(value) < 1e-4) return value.toExponential(2);
    return String(Number(value.toPrecision(digits)));
  }

  function toDate(value) {
    if (value === null || value === undefined || value === '') return null;
    if (typeof value === 'number') return new Date(value < 1e12 ? value * 1000 : value);
    const parsed = Date.parse(value);
    return Number.isNaN(parsed) ? null : new Date(parsed);
  }

  function fmtTime(value) {
    const date = toDate(value);
    if (!date) return '—';
    const pad = (n) => String(n).padStart(2, '0');
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
      `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  }

  /** A metric of a history line: a number, or a stats object ({mean, std, min, max}). */
  function stat(value, key = 'mean') {
    if (typeof value === 'number') return key === 'mean' ? value : null;
    if (value && typeof value === 'object' && typeof value[key] === 'number') return value[key];
    return null;
  }

  function prettyJson(value) {
    if (typeof value === 'string') {
      try { return JSON.stringify(JSON.parse(value), null, 2); } catch (_) { return value; }
    }
    try { return JSON.stringify(value, null, 2); } catch (_) { return String(value); }
  }

  /** Message content as text: a string, or OpenAI content parts. */
  function contentText(content) {
    if (content === null || content === undefined) return '';
    if (typeof content === 'string') return content;
    if (Array.isArray(content)) {
      return content.map((part) => {
        if (typeof part === 'string') return part;
        if (part && typeof part.text === 'string') return part.text;
        return prettyJson(part);
      }).join('\n');
    }
    return prettyJson(content);
  }

  function intOrNull(text) {
    if (text === '' || text === null || text === undefined) return null;
    const value = Number(text);
    return Number.isFinite(value) ? Math.trunc(value) : null;
  }

  function numOrNull(text) {
    if (text === '' || text === null || text === undefined) return null;
    const value = Number(text);
    return Number.isFinite(value) ? value : null;
  }

  // ------------------------------------------------------------------------------------------- state
  const S = {
    csrf: null,
    authRequired: false,
    started: false,
    tab: 'playground',
    modelIds: [],       // GET /v1/models
    trainable: [],      // GET /v1/trainable_models
    polls: {},
    pg: { cards: [], abort: null, rankNext: 1 },
    focus: { playground: -1, inbox: -1 },
    inbox: { before: null },
    traj: { items: [], selected: null },
    models: { name: null, live: null, runKey: null, pending: null, state: null, info: null, history: [] },
    jobs: { selected: null },
    drafts: new Map(),  // completion id -> comment typed (every input): outlives an element a redraw replaces
  };

  // ---------------------------------------------------------------------------------- status bar
  let statusTimer = null;

  function showStatus(message, kind) {
    const bar = $('#status');
    $('#status-text').textContent = message;
    bar.className = `status ${kind}`;
    bar.hidden = false;
    clearTimeout(statusTimer);
    if (kind !== 'error') statusTimer = setTimeout(() => { bar.hidden = true; }, 3500);
  }

  const showError = (message) => showStatus(message, 'error');
  const showInfo = (message) => showStatus(message, 'info');

  // ----------------------------------------------------------------------------------------- API
  class ApiError extends Error {
    constructor(message, status, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function errorFrom(response) {
    let message = `${response.status} ${response.statusText}`.trim();
    let code = null;
    try {
      const body = await response.json();
      if (body && body.error) {
        message = body.error.message || message;
        code = body.error.code || null;
      } else if (body && body.detail) {
        message = typeof body.detail === 'string' ? body.detail : JSON.stringify(body.detail);
      }
    } catch (_) { /* not JSON */ }
    return new ApiError(message, response.status, code);
  }

  function headersFor(method, json) {
    const headers = {};
    if (json) headers['Content-Type'] = 'application/json';
    if (method !== 'GET' && method !== 'HEAD' && S.csrf) headers['X-CSRF-Token'] = S.csrf;
    return headers;
  }

  /** fetch() a JSON route; API errors go to the status bar (unless quiet) and are thrown as ApiError. */
  async function api(path, { method = 'GET', body, query, quiet = false, signal } = {}) {
    const url = path + qs(query);
    let response;
    try {
      response = await fetch(url, {
        method,
        headers: headersFor(method, body !== undefined),
        body: body !== undefined ? JSON.stringify(body) : undefined,
        credentials: 'same-origin',
        signal,
      });
    } catch (error) {
      const failure = new ApiError(`${method} ${path}: ${error.message || 'network error'}`, 0, 'network_error');
      if (!quiet && error.name !== 'AbortError') showError(failure.message);
      throw failure;
    }
    if (!response.ok) {
      const failure = await errorFrom(response);
      if (response.status === 401 && S.authRequired && path !== '/ui/session') showLogin('Session expired: sign in again.');
      if (!quiet) showError(`${method} ${path}: ${failure.message}`);
      throw failure;
    }
    if (response.status === 204) return null;
    const type = response.headers.get('content-type') || '';
    return type.includes('json') ? response.json() : response.text();
  }

  // ---------------------------------------------------------------------------------- session
  function showLogin(message) {
    stopAllPolls();
    $('#login').hidden = false;
    $$('.tab-panel').forEach((panel) => { panel.hidden = true; });
    $('#tabs').hidden = true;
    const error = $('#login-error');
    error.hidden = !message;
    error.textContent = message || '';
    $('#login-key').focus();
  }

  async function boot() {
    let session;
    try {
      session = await api('/ui/session', { quiet: true });
    } catch (error) {
      showError(`cannot read /ui/session: ${error.message}`);
      return;
    }
    S.authRequired = Boolean(session.auth_required);
    S.csrf = session.csrf_token || null;
    $('#logout').hidden = !S.authRequired;
    if (S.authRequired && !session.authenticated) showLogin();
    else start();
  }

  async function login(event) {
    event.preventDefault();
    const key = $('#login-key').value;
    const error = $('#login-error');
    error.hidden = true;
    try {
      const answer = await api('/ui/session', { method: 'POST', body: { api_key: key }, quiet: true });
      S.csrf = answer.csrf_token || S.csrf;
      $('#login-key').value = '';
      $('#login').hidden = true;
      $('#logout').hidden = false;
      start();
    } catch (failure) {
      error.textContent = failure.status === 401 ? 'Invalid API key.' : failure.message;
      error.hidden = false;
    }
  }

  async function logout() {
    try { await api('/ui/session', { method: 'DELETE' }); } catch (_) { return; }
    S.csrf = null;
    S.started = false;
    showLogin('Signed out.');
  }

  function start() {
    $('#login').hidden = true;
    $('#tabs').hidden = false;
    S.started = true;
    const fromHash = location.hash.replace('#', '');
    setTab(PANELS[fromHash] ? fromHash : S.tab);
    loadModelLists().catch(() => {});
    showSandboxState().catch(() => {});
  }

  /** How this server runs user code (reward functions, graders, tools), from /health: a banner on every tab
   *  when it runs it unisolated (--unsafe-user-code) or refuses it; nothing when it is isolated. */
  async function showSandboxState() {
    const response = await fetch('/health', { credentials: 'same-origin' });
    const sandbox = (await response.json()).sandbox;
    const state = sandbox ? sandbox.user_code : 'isolated';
    const banner = $('#sandbox-banner');
    banner.hidden = state === 'isolated';
    if (banner.hidden) return;
    const unsafe = state.startsWith('UNSAFE');
    banner.className = `banner ${unsafe ? 'unsafe' : 'refused'}`;
    banner.textContent = unsafe
      ? 'Unsafe: this server runs user code (reward functions, graders, tools) unisolated, as its own user, '
        + 'with its network and files (--unsafe-user-code).'
      : `User code (reward functions, python graders, tools) is refused on this server: ${state.replace(/^refused: /, '')}`;
  }

  // ------------------------------------------------------------------------------------------- tabs
  const PANELS = {
    playground: { enter: () => {} },
    inbox: { enter: () => loadInbox() },
    models: { enter: () => enterModels() },
    trajectories: { enter: () => loadTrajectories() },
    jobs: { enter: () => poll('jobs', refreshJobs, 3000) },
  };

  function setTab(name) {
    if (!PANELS[name]) return;
    S.tab = name;
    stopAllPolls();
    $$('#tabs button').forEach((button) => button.classList.toggle('active', button.dataset.tab === name));
    $$('.tab-panel').forEach((panel) => { panel.hidden = panel.dataset.panel !== name; });
    if (location.hash !== `#${name}`) history.replaceState(null, '', `#${name}`);
    if (S.started) {
      if (name !== 'playground' && name !== 'models') loadModelLists().catch(() => {});
      Promise.resolve(PANELS[name].enter()).catch(() => {});
    }
  }

  function poll(name, fn, ms) {
    stopPoll(name);
    const handle = { stopped: false, timer: null };
    handle.stop = () => { handle.stopped = true; clearTimeout(handle.timer); };
    S.polls[name] = handle;
    const tick = async () => {
      if (handle.stopped) return;
      try { await fn(); } catch (_) { /* shown by api() or the panel */ }
      if (!handle.stopped) handle.timer = setTimeout(tick, ms);
    };
    tick();
  }

  function stopPoll(name) {
    if (S.polls[name]) S.polls[name].stop();
    delete S.polls[name];
  }

  function stopAllPolls() {
    Object.keys(S.polls).forEach(stopPoll);
  }

  // ---------------------------------------------------------------------------------- model lists
  function stepOf(id) {
    const at = id.lastIndexOf('@');
    return at > 0 && /^\d+$/.test(id.slice(at + 1)) ? [id.slice(0, at), Number(id.slice(at + 1))] : [id, null];
  }

  function fillSelect(select, options, { keep = true, fallback = null } = {}) {
    const previous = select.value;
    clear(select);
    for (const option of options) {
      if (option.group) {
        const group = h('optgroup', { label: option.group });
        option.options.forEach((o) => group.append(h('option', { value: o.value, text: o.label })));
        select.append(group);
      } else {
        select.append(h('option', { value: option.value, text: option.label }));
      }
    }
    const values = $$('option', select).map((o) => o.value);
    if (keep && values.includes(previous)) select.value = previous;
    else if (fallback !== null && values.includes(fallback)) select.value = fallback;
  }

  async function loadModelLists() {
    const [models, trainable] = await Promise.all([api('/v1/models'), api('/v1/trainable_models')]);
    S.modelIds = (models.data || []).map((m) => m.id);
    S.trainable = trainable.data || [];
    const names = S.trainable.map((m) => m.name);
    const bases = S.modelIds.filter((id) => !names.includes(stepOf(id)[0]));

    const playground = bases.map((id) => ({ value: id, label: id }));
    for (const model of S.trainable) {
      const stepIds = S.modelIds.filter((id) => stepOf(id)[0] === model.name && stepOf(id)[1] !== null)
        .sort((a, b) => stepOf(a)[1] - stepOf(b)[1]);
      playground.push({
        group: model.name,
        options: [{ value: model.name, label: `${model.name} (live: step ${model.latest_step})` },
          ...stepIds.map((id) => ({ value: id, label: id }))],
      });
    }
    fillSelect($('#pg-model'), playground, { fallback: names[0] || bases[0] || null });

    const filterOptions = [{ value: '', label: 'any model' }, ...bases.map((id) => ({ value: id, label: id })),
      ...names.map((name) => ({ value: name, label: name }))];
    fillSelect($('#inbox-model'), filterOptions);
    fillSelect($('#traj-model'), filterOptions);
    fillSelect($('#models-model'), names.map((name) => ({ value: name, label: name })),
      { fallback: S.models.name || names[0] || null });
  }

  // ------------------------------------------------------------------------------------ rating
  // thumb icons (after Feather's, MIT): drawn, so they show without an emoji font
  const THUMB_PATHS = {
    up: 'M14 9V5a3 3 0 0 0-3-3l-4 9v11h11.28a2 2 0 0 0 2-1.7l1.38-9a2 2 0 0 0-2-2.3zM7 22H4a2 2 0 0 1-2-2v-7a2 2 0 0 1 2-2h3',
    down: 'M10 15v4a3 3 0 0 0 3 3l4-9V2H5.72a2 2 0 0 0-2 1.7l-1.38 9a2 2 0 0 0 2 2.3zm7-13h2.67A2.31 2.31 0 0 1 22 4v7a2.31 2.31 0 0 1-2.33 2H17',
  };

  function thumbIcon(which) {
    return s('svg', { viewBox: '0 0 24 24', width: 16, height: 16, class: 'icon', 'aria-hidden': 'true' },
      s('path', { d: THUMB_PATHS[which] }));
  }

  /** The badge of a rated answer: [👍] rated, ★ 3 rated, skipped (icons drawn: no emoji font needed). */
  function ratingLabel(body) {
    if (body.kind === 'thumb') return [thumbIcon(body.value), ' rated'];
    if (body.kind === 'scale') return `★ ${body.value} rated`;
    if (body.kind === 'skip') return 'skipped';
    return 'rated';
  }

  function ratingTag(body) {
    if (body.kind === 'thumb') return body.value;
    if (body.kind === 'scale') return `scale-${body.value}`;
    return body.kind;
  }

  /**
   * Rating controls for one completion. `target` is an object with `completionId` (null until known) and
   * `root` (the element marked as rated); `onRated(target, body)` runs after the server took the rating.
   */
  function ratingControls(target, onRated) {
    const button = (action, label, title, body) => h('button', {
      type: 'button', class: `rate rate-${action}`, 'data-action': action, title, 'aria-label': title,
      onclick: (event) => { event.stopPropagation(); rate(target, body(), onRated); },
    }, label);
    const scale = h('div', { class: 'scale', role: 'group', 'aria-label': '1 to 5' },
      [1, 2, 3, 4, 5].map((v) => button(`scale-${v}`, String(v), `scale ${v} (key ${v})`,
        () => ({ kind: 'scale', value: v }))));
    target.comment = h('input', {
      type: 'text', class: 'comment', placeholder: 'comment (optional)', maxlength: '2000',
      onclick: (event) => event.stopPropagation(),
      oninput: () => keepDraft(target),
      onchange: () => {  // a comment typed after rating re-sends the same rating with it (it replaces the first)
        if (target.lastBody && target.lastBody.kind !== 'ranking') rate(target, { ...target.lastBody }, onRated);
      },
    });
    if (target.completionId !== null && target.completionId !== undefined) {
      target.comment.value = S.drafts.get(target.completionId) || '';
    }
    target.badge = h('span', { class: 'badge', hidden: true });
    const controls = h('div', { class: 'rating-controls' },
      h('div', { class: 'row small-gap' },
        button('up', thumbIcon('up'), 'thumbs up (key +)', () => ({ kind: 'thumb', value: 'up' })),
        button('down', thumbIcon('down'), 'thumbs down (key -)', () => ({ kind: 'thumb', value: 'down' })),
        scale,
        button('skip', 'Skip', 'skip (key s)', () => ({ kind: 'skip' })),
        target.badge),
      target.comment);
    target.controls = controls;
    setRatable(target, target.completionId !== null && target.completionId !== undefined);
    return controls;
  }

  /** Record the comment box's text as the draft of its completion (once the completion id is known). */
  function keepDraft(target) {
    if (target.completionId === null || target.completionId === undefined || !target.comment) return;
    S.drafts.set(target.completionId, target.comment.value);
  }

  /** The comment a rating sends: its completion's draft (the box may be one a redraw replaced), else the box's text. */
  function commentOf(target) {
    if (S.drafts.has(target.completionId)) return S.drafts.get(target.completionId);
    return target.comment ? target.comment.value : '';
  }

  function setRatable(target, ok) {
    if (!target.controls) return;
    $$('button', target.controls).forEach((b) => { b.disabled = !ok; });
  }

  function markRated(target, label, tag) {
    target.rated = tag;
    target.root.dataset.rated = tag;
    target.root.classList.add('rated');
    clear(target.badge);
    appendAll(target.badge, [label]);
    target.badge.title = typeof label === 'string' ? label : `${tag} rated`;
    target.badge.hidden = false;
  }

  async function rate(target, body, onRated) {
    if (target.completionId === null || target.completionId === undefined) {
      showError('This response has no completion id yet (still streaming or not recorded).');
      return;
    }
    const comment = commentOf(target).trim();
    const request = { ...body, completion_id: target.completionId };
    if (comment) request.comment = comment;
    try {
      await api('/v1/ratings', { method: 'POST', body: request });
    } catch (_) {
      return;
    }
    target.lastBody = body;
    markRated(target, ratingLabel(body), ratingTag(body));
    if (onRated) onRated(target, body);
  }

  // --------------------------------------------------------------------------------- playground
  function addTurn(role, content = '') {
    const container = $('#pg-turns');
    const select = h('select', { class: 'turn-role', 'aria-label': 'role' },
      h('option', { value: 'user', text: 'user' }), h('option', { value: 'assistant', text: 'assistant' }));
    select.value = role;
    const row = h('div', { class: 'turn' },
      h('div', { class: 'turn-head' }, select,
        h('button', {
          type: 'button', class: 'link remove-turn', title: 'remove this turn', text: 'remove',
          onclick: () => { if ($$('.turn', container).length > 1) row.remove(); },
        })),
      h('textarea', { class: 'turn-content', rows: 3, placeholder: 'message', value: content }));
    select.addEventListener('change', () => { row.dataset.role = select.value; });
    row.dataset.role = role;
    container.append(row);
    return row;
  }

  function conversation() {
    const messages = [];
    const system = $('#pg-system').value;
    if (system.trim()) messages.push({ role: 'system', content: system });
    for (const turn of $$('#pg-turns .turn')) {
      const content = $('.turn-content', turn).value;
      if (content.trim()) messages.push({ role: $('.turn-role', turn).value, content });
    }
    return messages;
  }

  function clampInt(value, lo, hi, fallback) {
    const n = Math.trunc(Number(value));
    return Number.isFinite(n) && value !== '' ? Math.min(hi, Math.max(lo, n)) : fallback;
  }

  function makeCard(index, model) {
    const card = {
      index, model, trajectoryId: `studio-${randomHex(8)}`, completionId: null, text: '', rated: null,
      toolCalls: {},
    };
    card.textEl = h('div', { class: 'card-text' });
    card.stateEl = h('span', { class: 'card-state', text: 'waiting…' });
    card.rankInput = h('input', {
      type: 'number', class: 'rank-input', min: 1, max: 8, title: 'rank (1 = best)', 'aria-label': 'rank',
      onclick: (event) => event.stopPropagation(),
      oninput: () => updateRanking(),
    });
    card.root = h('article', {
      class: 'card rateable', tabindex: 0, 'data-index': index, 'data-trajectory-id': card.trajectoryId,
      'data-state': 'streaming',
      onclick: (event) => {
        if (event.target.closest('button, input, select, textarea')) return;
        focusItem('playground', index);
        if ($('#pg-rank-mode').checked) toggleRank(card);
      },
    },
    h('header', { class: 'card-head' },
      h('span', { class: 'card-num', text: `#${index + 1}` }), card.stateEl,
      h('label', { class: 'rank-label' }, 'rank ', card.rankInput)),
    card.textEl,
    ratingControls(card, () => advanceFocus('playground')));
    return card;
  }

  function setCardState(card, state, label) {
    card.root.dataset.state = state;
    card.stateEl.textContent = label;
  }

  function renderCardText(card) {
    const calls = Object.values(card.toolCalls);
    let text = card.text;
    if (calls.length) {
      text += (text ? '\n' : '') + calls.map((c) => `→ tool call ${c.name || ''}(${c.arguments || ''})`).join('\n');
    }
    card.textEl.textContent = text;
    card.textEl.scrollTop = card.textEl.scrollHeight;
  }

  async function sample(event) {
    event.preventDefault();
    const model = $('#pg-model').value;
    const messages = conversation();
    if (!model) { showError('Pick a model first.'); return; }
    if (!messages.some((m) => m.role === 'user')) { showError('Write a user message first.'); return; }
    const n = clampInt($('#pg-n').value, 1, 8, 4);
    const temperature = numOrNull($('#pg-temperature').value);
    const maxTokens = clampInt($('#pg-max-tokens').value, 1, 32768, 128);
    if (S.pg.abort) S.pg.abort.abort();
    const abort = new AbortController();
    S.pg.abort = abort;
    const container = clear($('#pg-cards'));
    container.style.setProperty('--cols', String(Math.min(n, 4)));
    S.pg.cards = Array.from({ length: n }, (_, i) => makeCard(i, model));
    S.pg.cards.forEach((card) => container.append(card.root));
    S.focus.playground = -1;
    resetRanking();
    const payload = {
      model, messages, stream: true, stream_options: { include_usage: true },
      temperature: temperature === null ? 1.0 : temperature, max_tokens: maxTokens, metadata: { source: 'studio' },
    };
    const button = $('#pg-sample');
    button.disabled = true;
    button.textContent = 'Sampling…';
    try {
      await Promise.all(S.pg.cards.map((card) => streamInto(card, payload, abort.signal)));
    } finally {
      if (S.pg.abort === abort) {
        button.disabled = false;
        button.textContent = 'Sample';
      }
    }
  }

  async function streamInto(card, payload, signal) {
    setCardState(card, 'streaming', 'streaming…');
    let response;
    try {
      response = await fetch(`/t/${encodeURIComponent(card.trajectoryId)}/v1/chat/completions`, {
        method: 'POST', credentials: 'same-origin', signal,
        headers: { ...headersFor('POST', true), Accept: 'text/event-stream' },
        body: JSON.stringify(payload),
      });
    } catch (error) {
      if (error.name !== 'AbortError') failCard(card, error.message || 'network error');
      return;
    }
    if (!response.ok) {
      const failure = await errorFrom(response);
      failCard(card, failure.message);
      if (response.status === 401 && S.authRequired) showLogin('Session expired: sign in again.');
      return;
    }
    let failed = false;
    const handleLine = (line) => {
      if (!line.startsWith('data:')) return;
      const data = line.slice(5).trim();
      if (!data || data === '[DONE]') return;
      let chunk;
      try { chunk = JSON.parse(data); } catch (_) { return; }
      if (chunk.error) {
        failed = true;
        failCard(card, chunk.error.message || JSON.stringify(chunk.error));
        return;
      }
      if (chunk.usage) card.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const delta = choice.delta || {};
      if (typeof delta.content === 'string' && delta.content) card.text += delta.content;
      for (const call of delta.tool_calls || []) {
        const slot = card.toolCalls[call.index || 0] || (card.toolCalls[call.index || 0] = { name: '', arguments: '' });
        if (call.function && call.function.name) slot.name += call.function.name;
        if (call.function && call.function.arguments) slot.arguments += call.function.arguments;
      }
      if (choice.finish_reason) card.finishReason = choice.finish_reason;
      renderCardText(card);
    };
    try {
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let at;
        while ((at = buffer.indexOf('\n')) >= 0) {
          handleLine(buffer.slice(0, at).replace(/\r$/, ''));
          buffer = buffer.slice(at + 1);
        }
      }
      buffer += decoder.decode();
      if (buffer) handleLine(buffer.replace(/\r$/, ''));
    } catch (error) {
      if (error.name !== 'AbortError') failCard(card, `stream broken: ${error.message}`);
      return;
    }
    if (failed) return;
    setCardState(card, 'recording', 'recording…');
    const id = await completionIdOf(card.trajectoryId, signal);
    if (id === null) {
      failCard(card, 'the completion was not found in its trajectory (not recorded?)', true);
      return;
    }
    card.completionId = id;
    card.root.dataset.completionId = String(id);
    if (card.comment.value) keepDraft(card);  // typed while it streamed
    const tokens = card.usage && card.usage.completion_tokens;
    setCardState(card, 'done', `${card.finishReason || 'done'}${tokens ? ` · ${tokens} tok` : ''} · #${id}`);
    setRatable(card, true);
    updateRanking();
  }

  /** The completion id is not in the stream: read the trajectory once the server recorded it. */
  async function completionIdOf(trajectoryId, signal) {
    for (let attempt = 0; attempt < 12; attempt += 1) {
      if (signal && signal.aborted) return null;
      try {
        const view = await api(`/v1/trajectories/${encodeURIComponent(trajectoryId)}/view`, { quiet: true, signal });
        const completions = (view && view.completions) || [];
        if (completions.length) return completions[completions.length - 1].id;
      } catch (error) {
        if (error.status && error.status !== 404) {
          showError(`GET /v1/trajectories/${trajectoryId}/view: ${error.message}`);
          return null;
        }
      }
      await sleep(Math.min(250 * (attempt + 1), 1000));
    }
    return null;
  }

  function failCard(card, message, keepText = false) {
    setCardState(card, 'error', 'error');
    if (!keepText) card.text = '';
    card.textEl.textContent = card.text;
    card.textEl.append(h('div', { class: 'error-text', text: message }));
    showError(`sample #${card.index + 1}: ${message}`);
  }

  // best of N
  function resetRanking() {
    S.pg.cards.forEach((card) => { card.rankInput.value = ''; card.root.classList.remove('ranked'); });
    updateRanking();
  }

  function rankedCards() {
    return S.pg.cards
      .filter((card) => card.rankInput.value !== '' && Number.isFinite(Number(card.rankInput.value)))
      .sort((a, b) => Number(a.rankInput.value) - Number(b.rankInput.value) || a.index - b.index);
  }

  function toggleRank(card) {
    if (card.rated) return;
    if (card.rankInput.value !== '') {
      card.rankInput.value = '';
      rankedCards().forEach((c, i) => { c.rankInput.value = String(i + 1); });  // close the gap
    } else {
      card.rankInput.value = String(rankedCards().length + 1);
    }
    updateRanking();
  }

  function updateRanking() {
    const ranked = rankedCards();
    S.pg.cards.forEach((card) => card.root.classList.toggle('ranked', ranked.includes(card)));
    const ready = ranked.length >= 2 && ranked.every((c) => c.completionId !== null && !c.rated);
    const send = $('#pg-send-ranking');
    send.disabled = !ready;
    send.textContent = ranked.length ? `Send ranking (${ranked.length})` : 'Send ranking';
    $('#pg-clear-ranking').hidden = !ranked.length;
  }

  async function sendRanking() {
    const ranked = rankedCards();
    if (ranked.length < 2) { showError('Rank at least two responses (click them best → worst).'); return; }
    if (ranked.some((c) => c.completionId === null)) { showError('Wait until every ranked response is recorded.'); return; }
    const body = { kind: 'ranking', completion_ids: ranked.map((c) => c.completionId) };
    try {
      await api('/v1/ratings', { method: 'POST', body });
    } catch (_) {
      return;
    }
    ranked.forEach((card, i) => {
      card.lastBody = body;
      markRated(card, `#${i + 1} ranked`, `rank-${i + 1}`);
      card.rankInput.disabled = true;
    });
    updateRanking();
    showInfo(`Ranking of ${ranked.length} responses sent.`);
  }

  function toggleRankMode() {
    document.body.classList.toggle('ranking-mode', $('#pg-rank-mode').checked);
    updateRanking();
  }

  // ---------------------------------------------------------------------------------- keyboard
  function rateables(tab) {
    if (tab === 'playground') return S.pg.cards;
    if (tab === 'inbox') return S.inboxItems || [];
    return [];
  }

  function focusItem(tab, index) {
    const items = rateables(tab);
    if (!items.length) return;
    const i = Math.max(0, Math.min(items.length - 1, index));
    S.focus[tab] = i;
    items.forEach((item, k) => item.root.classList.toggle('focused', k === i));
    items[i].root.focus({ preventScroll: false });
  }

  function advanceFocus(tab) {
    const items = rateables(tab);
    const from = S.focus[tab];
    for (let k = from + 1; k < items.length; k += 1) {
      if (!items[k].rated) { focusItem(tab, k); return; }
    }
  }

  function onKey(event) {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const el = event.target;
    if (el && (el.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(el.tagName))) return;
    const tab = S.tab;
    if (tab !== 'playground' && tab !== 'inbox') return;
    if (event.key === 'Enter') {
      if (tab !== 'playground' || (el && el.tagName === 'BUTTON')) return;
      if (!$('#pg-send-ranking').disabled) { event.preventDefault(); sendRanking(); }
      return;
    }
    const items = rateables(tab);
    if (!items.length) return;
    let index = S.focus[tab];
    const current = () => items[index >= 0 ? index : 0];
    const click = (action) => {
      const target = current();
      if (index < 0) focusItem(tab, 0);
      const button = target.controls && $(`button[data-action="${action}"]`, target.controls);
      if (button && !button.disabled) button.click();
    };
    switch (event.key) {
      case 'j': index = index < 0 ? 0 : index + 1; focusItem(tab, index); break;
      case 'k': index = index < 0 ? 0 : index - 1; focusItem(tab, index); break;
      case '+': case '=': click('up'); break;
      case '-': case '_': click('down'); break;
      case '1': case '2': case '3': case '4': case '5': click(`scale-${event.key}`); break;
      case 's': click('skip'); break;
      case 'r': if (tab === 'playground' && $('#pg-rank-mode').checked) toggleRank(current()); break;
      default: return;
    }
    event.preventDefault();
  }

  // ------------------------------------------------------------------------------------- inbox
  function messageBlock(message) {
    const role = message.role || '?';
    const block = h('div', { class: `msg msg-${role.replace(/[^a-z_]/gi, '')}`, 'data-role': role },
      h('div', { class: 'msg-role' }, role,
        message.name ? h('span', { class: 'muted', text: ` (${message.name})` }) : null,
        message.tool_call_id ? h('span', { class: 'muted', text: ` → ${message.tool_call_id}` }) : null));
    const text = contentText(message.content);
    if (text) block.append(h('div', { class: 'msg-content', text }));
    if (message.tool_calls && message.tool_calls.length) {
      for (const call of message.tool_calls) {
        const fn = call.function || {};
        block.append(h('div', { class: 'tool-call' },
          h('div', { class: 'muted', text: `tool call ${fn.name || ''}${call.id ? ` (${call.id})` : ''}` }),
          h('pre', { class: 'json', text: prettyJson(fn.arguments !== undefined ? fn.arguments : call) })));
      }
    }
    return block;
  }

  function metadataChips(metadata) {
    if (!metadata || typeof metadata !== 'object') return null;
    const entries = Object.entries(metadata);
    if (!entries.length) return null;
    return h('span', { class: 'chips' }, entries.map(([k, v]) =>
      h('span', { class: 'chip', text: `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}` })));
  }

  function metadataFilter(text) {
    const value = text.trim();
    if (value && !value.includes('=')) showError('Metadata filter must look like key=value.');
    return value || null;
  }

  // Loads race (a tab opening, a filter change, a refresh): only the newest request of a kind may render.
  const tickets = {};

  function ticket(kind) {
    tickets[kind] = (tickets[kind] || 0) + 1;
    return tickets[kind];
  }

  const isLatest = (kind, number) => tickets[kind] === number;

  function inboxEntry(item) {
    const entry = { completionId: item.completion_id, rated: null };
    entry.root = h('article', {
      class: 'inbox-item rateable', tabindex: 0, 'data-completion-id': String(item.completion_id),
      onclick: (event) => {
        if (!event.target.closest('button, input')) focusItem('inbox', S.inboxItems.indexOf(entry));
      },
    },
    h('header', { class: 'item-head' },
      h('span', { class: 'strong', text: item.served_model || item.model || '' }),
      item.step !== null && item.step !== undefined ? h('span', { class: 'muted', text: `step ${item.step}` }) : null,
      h('span', { class: 'muted', text: fmtTime(item.created_at) }),
      h('span', { class: 'muted mono', text: `#${item.completion_id} · ${item.trajectory_id || ''}` }),
      metadataChips(item.metadata)),
    h('div', { class: 'item-body' },
      h('div', { class: 'prompt' }, (item.messages || []).map(messageBlock)),
      h('div', { class: 'response' },
        h('div', { class: 'msg-role', text: 'response' }),
        h('div', { class: 'msg-content', text: contentText(item.response && item.response.content) }))),
    ratingControls(entry, (target) => {
      // rated items leave the inbox
      target.root.classList.add('leaving');
      setTimeout(() => {
        const at = S.inboxItems.indexOf(target);
        if (at >= 0) S.inboxItems.splice(at, 1);
        target.root.remove();
        if (S.focus.inbox >= S.inboxItems.length) S.focus.inbox = S.inboxItems.length - 1;
        if (S.inboxItems.length && S.focus.inbox >= 0) focusItem('inbox', S.focus.inbox);
        updateInboxCount();
      }, 250);
    }));
    return entry;
  }

  async function loadInbox(more = false) {
    const query = {
      model: $('#inbox-model').value || null,
      step: intOrNull($('#inbox-step').value),
      metadata: metadataFilter($('#inbox-metadata').value),
      limit: 20,
      before: more ? S.inbox.before : null,
    };
    const number = ticket('inbox');
    const list = $('#inbox-list');
    list.dataset.state = 'loading';  // 'ready' once the newest load is drawn (tests wait on it)
    let answer;
    try {
      answer = await api('/v1/ratings/inbox', { query });
    } catch (_) {
      if (isLatest('inbox', number)) list.dataset.state = 'error';
      return;
    }
    if (!isLatest('inbox', number)) return;
    const items = answer.data || [];
    if (more) {
      for (const item of items) {
        if (S.inboxItems.some((e) => e.completionId === item.completion_id)) continue;
        const entry = inboxEntry(item);
        S.inboxItems.push(entry);
        list.append(entry.root);
      }
    } else {
      // Items already shown keep their element, in place: a comment being typed keeps its text, the focus
      // and the caret through a refresh (an item drawn anew gets its draft back from S.drafts).
      const shown = new Map((S.inboxItems || []).filter((e) => !e.rated).map((e) => [e.completionId, e]));
      const focused = S.inboxItems && S.focus.inbox >= 0 ? S.inboxItems[S.focus.inbox] : null;
      S.inboxItems = items.map((item) => shown.get(item.completion_id) || inboxEntry(item));
      drawChildren(list, S.inboxItems.map((e) => e.root));
      S.focus.inbox = focused ? S.inboxItems.indexOf(focused) : -1;
    }
    S.inbox.before = items.length ? items[items.length - 1].completion_id : S.inbox.before;
    S.inbox.hasMore = Boolean(answer.has_more);
    $('#inbox-more').hidden = !answer.has_more;
    updateInboxCount();
    list.dataset.state = 'ready';
  }

  function updateInboxCount() {
    const n = (S.inboxItems || []).length;
    $('#inbox-count').textContent = n ? `${n} unrated${S.inbox.hasMore ? '+' : ''}` : 'nothing to rate';
    if (!n && !$('#inbox-list .empty')) {
      $('#inbox-list').append(h('p', { class: 'muted empty', text: 'No unrated completion matches.' }));
    }
  }

  // ------------------------------------------------------------------------------------ models
  async function enterModels() {
    await loadModelLists();
    const name = $('#models-model').value;
    const none = !name;
    $('#models-empty').hidden = !none;
    $('#models-body').hidden = none;
    if (none) return;
    await selectModel(name);
  }

  async function selectModel(name) {
    const changed = S.models.name !== name;
    S.models.name = name;
    if (changed) {
      S.models.live = null;
      S.models.runKey = null;
      S.models.pending = null;
      S.models.state = null;
      clearDirty();
    }
    await Promise.all([loadModelDetail(name), loadRatingsList(name)]);
    poll('continual', () => loadContinual(name), 1500);
  }

  async function loadModelDetail(name) {
    const number = ticket('model-detail');
    const [info, history] = await Promise.all([
      api(`/v1/trainable_models/${encodeURIComponent(name)}`),
      api(`/v1/trainable_models/${encodeURIComponent(name)}/history`).catch(() => ({ data: [] })),
    ]);
    if (S.models.name !== name || !isLatest('model-detail', number)) return;
    S.models.info = info;
    S.models.history = history.data || [];
    S.models.live = info.latest_step;
    const pill = $('#models-live');
    pill.dataset.liveStep = String(info.latest_step);
    pill.dataset.model = name;
    pill.textContent = `live: step ${info.latest_step}`;
    $('#models-base').textContent = `base ${info.base_model}`;
    renderStepTable(info, S.models.history);
    renderCharts(S.models.history);
  }

  function historyByStep(lines) {
    const map = new Map();
    for (const line of lines) {
      if (line && !line.event && typeof line.step === 'number') map.set(line.step, line);
    }
    return map;
  }

  /** Each step's recorded evaluations (`"event": "eval"` lines), as "split metric value" texts; a later
   * line for the same split and metric replaces an earlier one. */
  function evaluationsByStep(lines) {
    const map = new Map();
    for (const line of lines) {
      if (!line || line.event !== 'eval' || typeof line.step !== 'number' || !line.eval) continue;
      const scores = map.get(line.step) || new Map();
      for (const [metric, value] of Object.entries(line.eval)) {
        scores.set(`${line.split} ${metric}`, fmtNum(value));
      }
      map.set(line.step, scores);
    }
    return map;
  }

  function renderStepTable(info, lines) {
    const tbody = clear($('#steps-table tbody'));
    const byStep = historyByStep(lines);
    const evaluations = evaluationsByStep(lines);
    const steps = new Map();
    for (const step of info.steps || []) steps.set(step.step, step);
    for (const step of byStep.keys()) if (!steps.has(step)) steps.set(step, { step, missing: true });
    const order = Array.from(steps.keys()).sort((a, b) => b - a);
    for (const stepNo of order) {
      const step = steps.get(stepNo);
      const line = byStep.get(stepNo) || {};
      const live = stepNo === info.latest_step;
      const mean = stat(line.reward, 'mean');
      const std = stat(line.reward, 'std');
      const tps = line.trainable_tokens && line.train_seconds ? line.trainable_tokens / line.train_seconds : null;
      const promoted = line.promoted !== undefined ? line.promoted : step.promoted;
      const notes = line.annotations || {};
      const source = line.source || notes.source || (stepNo === 0 ? 'init' : '—');
      const rated = line.ratings ?? notes.ratings;
      const replayed = line.replayed ?? notes.replayed;
      const scores = Array.from(evaluations.get(stepNo) || [], ([key, value]) => `${key} ${value}`).join('; ');
      const action = live
        ? h('span', { class: 'live-tag', text: 'live' })
        : h('button', {
          type: 'button', class: 'secondary serve', 'data-step': stepNo, text: 'Serve this step',
          disabled: Boolean(step.missing), onclick: () => serveStep(info.name, stepNo),
        });
      tbody.append(h('tr', { 'data-step': stepNo, class: live ? 'live' : '' },
        h('td', { class: 'mono' }, String(stepNo), step.loaded ? h('span', { class: 'dot', title: 'loaded in the engine' }) : null),
        h('td', { text: fmtTime(line.time || step.created_at) }),
        h('td', { text: mean === null ? '—' : `${fmtNum(mean)} ± ${fmtNum(std)}` }),
        h('td', { text: fmtNum(stat(line.loss)) }),
        h('td', { text: fmtNum(stat(line.kl)) }),
        h('td', { text: fmtNum(stat(line.clip_fraction)) }),
        h('td', { text: fmtNum(stat(line.entropy)) }),
        h('td', { text: fmtNum(tps, 3) }),
        h('td', { text: line.groups_skipped === undefined ? '—' : String(line.groups_skipped) }),
        h('td', { text: typeof rated === 'number' ? `${source} (${rated}${replayed ? ` + ${replayed} replayed` : ''})` : source }),
        h('td', { text: promoted === undefined || promoted === null ? '—' : (promoted ? 'yes' : 'no'),
          title: line.guard ? prettyJson(line.guard) : null }),
        h('td', { class: 'evaluations', text: scores || '—' }),
        h('td', {}, action)));
    }
  }

  async function serveStep(name, step) {
    try {
      await api(`/v1/trainable_models/${encodeURIComponent(name)}/alias`,
        { method: 'POST', body: { step, reason: 'served from the studio page' } });
    } catch (_) {
      return;
    }
    showInfo(`${name} now serves step ${step}.`);
    await Promise.all([loadModelDetail(name), loadModelLists()]).catch(() => {});
  }

  // continual training
  const dirty = new Set();

  function clearDirty() { dirty.clear(); }

  function setField(el, value) {
    if (dirty.has(el.id) || document.activeElement === el) return;
    if (el.type === 'checkbox') el.checked = Boolean(value);
    else el.value = value === null || value === undefined ? '' : String(value);
  }

  async function loadContinual(name) {
    let status;
    try {
      status = await api(`/v1/trainable_models/${encodeURIComponent(name)}/continual`, { quiet: true });
    } catch (error) {
      if (S.models.name === name) {
        $('#ct-message').textContent = `continual training unavailable: ${error.message}`;
      }
      return;
    }
    if (S.models.name !== name) return;
    renderContinual(status);
    const run = status.last_run;
    const runKey = run ? `${run.started_at}:${run.step}:${run.promoted}:${(run.events || []).length}` : '';
    const changed = (status.live_step !== undefined && status.live_step !== S.models.live) ||
      (S.models.state !== null && status.state !== S.models.state) || (S.models.runKey !== null && runKey !== S.models.runKey);
    const pendingChanged = S.models.pending !== null && status.pending_ratings !== S.models.pending;
    S.models.state = status.state;
    S.models.runKey = runKey;
    S.models.pending = status.pending_ratings;
    if (changed) await Promise.all([loadModelDetail(name), loadRatingsList(name), loadModelLists()]).catch(() => {});
    else if (pendingChanged) await loadRatingsList(name).catch(() => {});
  }

  function renderContinual(status) {
    const policy = status.policy || {};
    const guard = policy.guard || {};
    $('#ct-message').textContent = status.message || '—';
    $('#ct-message').dataset.model = status.model || '';
    const state = $('#ct-state');
    state.dataset.state = status.state || '';
    state.textContent = status.state || '—';
    const every = Number(policy.every) || 0;
    const pending = Number(status.pending_ratings) || 0;
    $('#ct-queue').textContent = `${pending} / ${every || '?'} ratings pending` +
      (status.trained_ratings !== undefined ? ` · ${status.trained_ratings} trained` : '');
    $('#ct-queue-fill').style.width = `${every ? Math.min(100, (100 * pending) / every) : 0}%`;
    setField($('#ct-enabled'), policy.enabled);
    setField($('#ct-every'), policy.every);
    setField($('#ct-objective'), policy.objective || 'grpo');
    setField($('#ct-replay'), policy.replay);
    setField($('#ct-guard-enabled'), guard.enabled);
    setField($('#ct-guard-margin'), guard.margin);
    $('#continual').dataset.state = status.state || '';
    $('#continual').dataset.enabled = String(Boolean(policy.enabled));
    renderRun(status.last_run);
  }

  function eventLine(event) {
    const type = event.type || event.event || 'event';
    const parts = [];
    for (const [key, value] of Object.entries(event)) {
      if (key === 'type' || value === null || value === undefined) continue;
      if (typeof value === 'number') parts.push(`${key} ${fmtNum(value)}`);
      else if (typeof value === 'string' || typeof value === 'boolean') parts.push(`${key} ${value}`);
      else if (typeof value === 'object' && typeof value.mean === 'number') parts.push(`${key} ${fmtNum(value.mean)}`);
      if (parts.length >= 10) break;
    }
    return h('li', { class: `event event-${String(type).replace(/[^a-z_]/gi, '')}`, 'data-type': type },
      h('span', { class: 'event-type', text: type }), h('span', { class: 'event-fields', text: parts.join(' · ') }));
  }

  function renderRun(run) {
    const list = $('#ct-events');
    const summary = $('#ct-run-summary');
    const key = run ? JSON.stringify([run.started_at, run.step, run.promoted, run.reason, (run.events || []).length]) : '';
    if (list.dataset.key === key) return;
    list.dataset.key = key;
    clear(list);
    if (!run) {
      summary.textContent = 'no run yet';
      return;
    }
    let text = run.step !== null && run.step !== undefined ? `step ${run.step}` : (run.finished_at ? 'no step' : 'running');
    if (typeof run.ratings === 'number') text += ` · ${run.ratings} ratings${run.replayed ? ` + ${run.replayed} replayed` : ''}`;
    if (run.promoted === true) text += ' · promoted';
    else if (run.promoted === false) text += ' · not promoted';
    if (run.reason) text += ` · ${run.reason}`;
    summary.textContent = text;
    (run.events || []).forEach((event) => list.append(eventLine(event)));
    list.scrollTop = list.scrollHeight;
  }

  async function patchContinual(body) {
    const name = S.models.name;
    if (!name) return null;
    try {
      const status = await api(`/v1/trainable_models/${encodeURIComponent(name)}/continual`, { method: 'PATCH', body });
      clearDirty();
      if (S.models.name === name) renderContinual(status);
      return status;
    } catch (_) {
      return null;
    }
  }

  function continualSettings() {
    const body = {};
    const every = intOrNull($('#ct-every').value);
    if (every !== null) body.every = every;
    body.objective = $('#ct-objective').value;
    const replay = intOrNull($('#ct-replay').value);
    if (replay !== null) body.replay = replay;
    const guard = { enabled: $('#ct-guard-enabled').checked };
    const margin = numOrNull($('#ct-guard-margin').value);
    if (margin !== null) guard.margin = margin;
    body.guard = guard;
    return body;
  }

  async function toggleContinual() {
    const box = $('#ct-enabled');
    const wanted = box.checked;
    dirty.add(box.id);
    const body = { enabled: wanted };
    const every = intOrNull($('#ct-every').value);
    if (dirty.has('ct-every') && every !== null) body.every = every;  // an edited K goes with the switch
    const status = await patchContinual(body);
    if (!status) { dirty.delete(box.id); box.checked = !wanted; return; }
    showInfo(`Continual training ${wanted ? 'on' : 'off'} for ${S.models.name}.`);
  }

  // recent ratings of the selected model
  async function loadRatingsList(name) {
    const number = ticket('ratings');
    let answer;
    try {
      answer = await api('/v1/ratings', { query: { model: name, limit: 1000 }, quiet: true });
    } catch (error) {
      if (isLatest('ratings', number)) $('#ratings-count').textContent = `unavailable: ${error.message}`;
      return;
    }
    if (S.models.name !== name || !isLatest('ratings', number)) return;
    const all = answer.data || [];
    const list = clear($('#ratings-list'));
    $('#ratings-count').textContent = `${all.length}${answer.has_more ? '+' : ''} ratings`;
    for (const rating of all.slice(-50).reverse()) list.append(ratingItem(rating));
    if (!all.length) list.append(h('li', { class: 'muted', text: 'No rating yet.' }));
  }

  function ratingItem(rating) {
    let value = rating.kind;
    if (rating.kind === 'thumb') value = thumbIcon(rating.value === 'up' ? 'up' : 'down');
    else if (rating.kind === 'scale') value = `★ ${rating.value}`;
    else if (rating.kind === 'ranking') value = typeof rating.value === 'number' ? `rank #${rating.value + 1}` : 'ranking';
    else if (rating.kind === 'skip') value = 'skip';
    const trained = rating.trained_in_step === null || rating.trained_in_step === undefined
      ? (rating.kind === 'skip' ? '' : 'pending') : `trained in step ${rating.trained_in_step}`;
    return h('li', { class: 'rating-item', 'data-rating-id': String(rating.id) },
      h('div', { class: 'row small-gap' },
        h('span', { class: `rating-value rating-${rating.kind}`, title: `${rating.kind} ${rating.value ?? ''}` }, value),
        h('span', { class: 'muted', text: `#${rating.completion_id} · step ${rating.step ?? '—'}` }),
        rating.reward !== null && rating.reward !== undefined ? h('span', { class: 'muted', text: `reward ${fmtNum(rating.reward)}` }) : null,
        trained ? h('span', { class: `chip ${rating.trained_in_step == null ? '' : 'chip-ok'}`, text: trained }) : null,
        rating.rater ? h('span', { class: 'muted', text: `by ${rating.rater}` }) : null,
        h('span', { class: 'muted grow right', text: fmtTime(rating.created_at) })),
      rating.comment ? h('div', { class: 'rating-comment', text: rating.comment }) : null);
  }

  // --------------------------------------------------------------------------------------- charts
  const CHARTS = [
    { key: 'reward', title: 'reward (mean ± std)', get: (l) => stat(l.reward, 'mean'), band: (l) => stat(l.reward, 'std') },
    { key: 'loss', title: 'loss', get: (l) => stat(l.loss) },
    { key: 'kl', title: 'KL', get: (l) => stat(l.kl) },
    { key: 'clip_fraction', title: 'clip fraction', get: (l) => stat(l.clip_fraction) },
    { key: 'entropy', title: 'entropy', get: (l) => stat(l.entropy) },
    { key: 'tokens_per_s', title: 'train tokens/s',
      get: (l) => (l.trainable_tokens && l.train_seconds ? l.trainable_tokens / l.train_seconds : null) },
    { key: 'groups_skipped', title: 'zero-variance groups (skipped)',
      get: (l) => (typeof l.groups_skipped === 'number' ? l.groups_skipped : null) },
    // Why learning slows: groups without signal, prompts already solved, answers the policy is sure of.
    { key: 'zero_variance_fraction', title: 'zero-variance fraction of groups', get: (l) => stat(l.zero_variance_fraction) },
    { key: 'pass_rate', title: 'pass rate (trajectories ≥ pass_threshold)', get: (l) => stat(l.pass_rate) },
    { key: 'groups_mixed', title: 'groups mixed (neither all-wrong nor all-right)', get: (l) => stat(l.groups_mixed) },
    { key: 'sampling_entropy', title: 'sampling entropy (−logprob of sampled tokens)', get: (l) => stat(l.sampling_entropy) },
    { key: 'kl_to_base', title: 'KL to base', get: (l) => stat(l.kl_to_base) },
    { key: 'response_tokens', title: 'response tokens (mean)', get: (l) => stat(l.response_tokens_mean) },
    // The settings each step trained with, which schedules and the entropy control move from step to step.
    { key: 'learning_rate', title: 'learning rate', get: (l) => stat(l.config && l.config.learning_rate) },
    { key: 'entropy_coef', title: 'entropy bonus (entropy_coef)', get: (l) => stat(l.config && l.config.entropy_coef) },
  ];

  function renderCharts(lines) {
    const container = clear($('#charts'));
    const steps = Array.from(historyByStep(lines).values()).sort((a, b) => a.step - b.step);
    const aliases = lines.filter((l) => l && l.event === 'alias');
    for (const def of CHARTS) container.append(chart(def, steps, aliases));
  }

  function niceTicks(lo, hi, count = 4) {
    const span = hi - lo;
    const raw = span / count;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((m) => span / m <= count) || raw;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
    return ticks;
  }

  function fmtTick(value) {
    // as many digits as tell neighbouring ticks apart (9.5e-5, 1e-4, 1.05e-4)
    if (value !== 0 && Math.abs(value) < 1e-3) return Number(value.toPrecision(3)).toExponential();
    return fmtNum(value, 3);
  }

  function chart(def, lines, aliases) {
    const W = 360;
    const H = 180;
    const M = { l: 48, r: 12, t: 12, b: 26 };
    const points = lines.map((l) => ({ step: l.step, value: def.get(l), band: def.band ? def.band(l) : null }))
      .filter((p) => typeof p.value === 'number' && Number.isFinite(p.value));
    const svg = s('svg', {
      viewBox: `0 0 ${W} ${H}`, class: 'chart-svg', 'data-chart': def.key, role: 'img', 'aria-label': def.title,
      preserveAspectRatio: 'xMidYMid meet',
    });
    const wrap = h('figure', { class: 'chart' }, h('figcaption', { text: def.title }), svg);
    if (!points.length) {
      svg.append(s('text', { x: W / 2, y: H / 2, class: 'chart-empty', 'text-anchor': 'middle', text: 'no data yet' }));
      return wrap;
    }
    let xlo = Math.min(...points.map((p) => p.step));
    let xhi = Math.max(...points.map((p) => p.step));
    xlo -= 0.35;
    xhi += 0.35;
    let ylo = Math.min(...points.map((p) => p.value - (p.band || 0)));
    let yhi = Math.max(...points.map((p) => p.value + (p.band || 0)));
    const nonNegative = points.every((p) => p.value - (p.band || 0) >= 0);
    if (ylo === yhi) {
      const pad = Math.abs(ylo) * 0.1 || 1;
      ylo -= pad; yhi += pad;
    } else {
      const pad = (yhi - ylo) * 0.08;
      ylo -= pad; yhi += pad;
    }
    if (nonNegative && ylo < 0) ylo = 0;
    const x = (v) => M.l + ((v - xlo) / (xhi - xlo)) * (W - M.l - M.r);
    const y = (v) => H - M.b - ((v - ylo) / (yhi - ylo)) * (H - M.t - M.b);

    const grid = s('g', { class: 'grid' });
    for (const t of niceTicks(ylo, yhi)) {
      grid.append(s('line', { x1: M.l, x2: W - M.r, y1: y(t), y2: y(t) }));
      grid.append(s('text', { x: M.l - 6, y: y(t) + 4, 'text-anchor': 'end', class: 'tick', text: fmtTick(t) }));
    }
    const xticks = niceTicks(xlo, xhi, Math.min(6, xhi - xlo)).filter((t) => Number.isInteger(t));
    for (const t of xticks) {
      grid.append(s('text', { x: x(t), y: H - M.b + 16, 'text-anchor': 'middle', class: 'tick', text: String(t) }));
    }
    grid.append(s('line', { class: 'axis', x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }));
    svg.append(grid);

    for (const move of aliases) {
      const at = move.alias_step;
      if (typeof at !== 'number' || at < xlo || at > xhi) continue;
      svg.append(s('line', { class: 'alias-move', x1: x(at), x2: x(at), y1: M.t, y2: H - M.b },
        s('title', { text: `alias → step ${at} (from ${move.previous_step ?? '?'})` +
          `${move.reason ? `: ${move.reason}` : ''} at ${fmtTime(move.time)}` })));
    }

    const banded = points.filter((p) => typeof p.band === 'number');
    if (banded.length) {
      const upper = banded.map((p) => `${x(p.step)},${y(p.value + p.band)}`);
      const lower = banded.slice().reverse().map((p) => `${x(p.step)},${y(p.value - p.band)}`);
      svg.append(s('polygon', { class: 'band', points: [...upper, ...lower].join(' ') }));
      for (const p of banded) {  // ± std as an error bar too (a single step has no band to draw)
        svg.append(s('line', { class: 'errbar', x1: x(p.step), x2: x(p.step), y1: y(p.value - p.band), y2: y(p.value + p.band) }));
      }
    }
    if (points.length > 1) {
      svg.append(s('polyline', { class: 'line', points: points.map((p) => `${x(p.step)},${y(p.value)}`).join(' ') }));
    }
    for (const p of points) {
      svg.append(s('circle', {
        class: 'point', cx: x(p.step), cy: y(p.value), r: 3.5, 'data-step': p.step, 'data-value': String(p.value),
      }, s('title', { text: `step ${p.step}: ${fmtNum(p.value, 6)}${typeof p.band === 'number' ? ` ± ${fmtNum(p.band)}` : ''}` })));
    }
    return wrap;
  }

  // -------------------------------------------------------------------------------- trajectories
  function dateToUnix(value, endOfDay) {
    if (!value) return null;
    const date = new Date(`${value}T00:00:00`);
    if (Number.isNaN(date.getTime())) return null;
    return Math.floor(date.getTime() / 1000) + (endOfDay ? 86400 : 0);
  }

  async function loadTrajectories(more = false) {
    const query = {
      model: $('#traj-model').value || null,
      step: intOrNull($('#traj-step').value),
      min_reward: numOrNull($('#traj-min-reward').value),
      max_reward: numOrNull($('#traj-max-reward').value),
      since: dateToUnix($('#traj-since').value, false),
      until: dateToUnix($('#traj-until').value, true),
      metadata: metadataFilter($('#traj-metadata').value),
      limit: 50,
      before: more ? S.traj.before : null,
    };
    const number = ticket('trajectories');
    let answer;
    try {
      answer = await api('/v1/trajectories', { query });
    } catch (_) {
      return;
    }
    if (!isLatest('trajectories', number)) return;
    const tbody = $('#traj-table tbody');
    if (!more) clear(tbody);
    const items = answer.data || [];
    for (const item of items) {
      const row = h('tr', {
        'data-trajectory-id': item.trajectory_id, tabindex: 0,
        onclick: () => openTrajectory(item.trajectory_id),
        onkeydown: (event) => { if (event.key === 'Enter') openTrajectory(item.trajectory_id); },
      },
      h('td', { class: 'mono ellipsis', text: item.trajectory_id, title: item.trajectory_id }),
      h('td', { class: 'ellipsis', text: trajectoryModels(item) }),
      h('td', { text: String(item.completions ?? '') }),
      h('td', { text: fmtNum(item.reward) }),
      h('td', { text: ratingSummary(item.rating) }),
      h('td', { class: 'muted', text: fmtTime(item.created_at).slice(5, 16), title: fmtTime(item.created_at) }));
      if (S.traj.selected === item.trajectory_id) row.classList.add('selected');
      tbody.append(row);
    }
    if (!more && !items.length) tbody.append(h('tr', {}, h('td', { colspan: 6, class: 'muted', text: 'No trajectory matches.' })));
    S.traj.before = answer.last_id ?? (items.length ? items[items.length - 1].last_id : S.traj.before);
    $('#traj-more').hidden = !answer.has_more;
  }

  function trajectoryModels(item) {
    const models = Array.isArray(item.models) ? item.models : (item.model ? [item.model] : []);
    const steps = Array.isArray(item.steps) ? item.steps.filter((x) => x !== null && x !== undefined) : [];
    const text = models.join(', ');
    return steps.length && !models.some((m) => m.includes('@')) ? `${text} @${steps.join(',')}` : text;
  }

  function ratingSummary(rating) {
    if (typeof rating === 'number') return fmtNum(rating, 3);
    if (rating === null || rating === undefined) return '—';
    if (typeof rating !== 'object') return String(rating);
    if (Array.isArray(rating)) return rating.map(ratingSummary).join(', ');
    if (rating.kind === 'thumb') return rating.value === 'up' ? 'up' : 'down';
    if (rating.kind === 'scale') return `★ ${rating.value}`;
    if (rating.kind) return rating.reward !== undefined && rating.reward !== null ? `${rating.kind} ${fmtNum(rating.reward)}` : rating.kind;
    return prettyJson(rating);
  }

  function tokenColor(logprob) {
    if (typeof logprob !== 'number' || !Number.isFinite(logprob)) return null;
    const p = Math.max(0, Math.min(1, Math.exp(logprob)));
    return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(82 + 6 * p)}%)`;
  }

  function tokenView(tokens) {
    const view = h('div', { class: 'tokens', 'data-count': tokens.length });
    for (const token of tokens) {
      const lp = token.logprob;
      const span = h('span', {
        class: 'tok', title: typeof lp === 'number' ? `logprob ${lp.toFixed(3)}` : 'logprob n/a',
        'data-logprob': typeof lp === 'number' ? String(lp) : '',
        text: token.text ?? '',
      });
      const colour = tokenColor(lp);
      if (colour) span.style.backgroundColor = colour;
      if (!token.text) span.classList.add('tok-empty');
      view.append(span);
    }
    return view;
  }

  async function openTrajectory(id) {
    S.traj.selected = id;
    $$('#traj-table tbody tr').forEach((row) => row.classList.toggle('selected', row.dataset.trajectoryId === id));
    const pane = $('#traj-view');
    let view;
    try {
      view = await api(`/v1/trajectories/${encodeURIComponent(id)}/view`);
    } catch (_) {
      return;
    }
    if (S.traj.selected !== id) return;
    clear(pane);
    pane.dataset.trajectoryId = id;
    pane.append(h('header', { class: 'row spread' },
      h('h3', { class: 'mono ellipsis', text: id }),
      h('span', { class: 'muted', text: `reward ${fmtNum(view.reward)} · ${(view.completions || []).length} completion(s)` })));
    for (const completion of view.completions || []) {
      const target = { completionId: completion.id, rated: null };
      const tokens = completion.tokens || [];
      target.root = h('section', { class: 'completion', 'data-completion-id': String(completion.id) },
        h('div', { class: 'row small-gap item-head' },
          h('span', { class: 'strong', text: `#${completion.id}` }),
          h('span', { text: completion.served_model || completion.model || '' }),
          completion.step !== null && completion.step !== undefined ? h('span', { class: 'muted', text: `step ${completion.step}` }) : null,
          h('span', { class: 'muted', text: `finish ${completion.finish_reason || '—'}` }),
          h('span', { class: 'muted', text: fmtTime(completion.created_at) })),
        completion.tools && completion.tools.length
          ? h('details', { class: 'tools' }, h('summary', { text: `tools (${completion.tools.length})` }),
            h('pre', { class: 'json', text: prettyJson(completion.tools) }))
          : null,
        h('div', { class: 'prompt' }, (completion.messages || []).map(messageBlock)),
        h('div', { class: 'response' },
          h('div', { class: 'msg-role', text: 'response' }),
          h('div', { class: 'msg-content', text: contentText(completion.response && completion.response.content) }),
          completion.response && completion.response.tool_calls
            ? messageBlock({ role: 'assistant', tool_calls: completion.response.tool_calls }) : null),
        h('div', { class: 'row spread' },
          h('span', { class: 'msg-role', text: `tokens (${tokens.length}) · colour = probability` }),
          h('span', { class: 'legend' }, h('span', { class: 'legend-lo', text: 'low' }), h('span', { class: 'legend-bar' }),
            h('span', { class: 'legend-hi', text: 'high' }))),
        tokenView(tokens),
        ratingControls(target, () => {}));
      pane.append(target.root);
    }
  }

  // -------------------------------------------------------------------------------------- jobs
  async function refreshJobs() {
    const answer = await api('/v1/fine_tuning/jobs', { query: { limit: 50 }, quiet: S.jobs.failed });
    S.jobs.failed = false;
    const tbody = clear($('#jobs-table tbody'));
    const jobs = answer.data || [];
    $('#jobs-empty').hidden = jobs.length > 0;
    for (const job of jobs) {
      tbody.append(h('tr', {
        'data-job-id': job.id, class: S.jobs.selected === job.id ? 'selected' : '', tabindex: 0,
        onclick: () => { S.jobs.selected = job.id; refreshJobs().catch(() => {}); },
      },
      h('td', { class: 'mono', text: job.id }),
      h('td', {}, h('span', { class: `state-pill job-${job.status}`, 'data-state': job.status, text: job.status })),
      h('td', { text: (job.method && job.method.type) || '—' }),
      h('td', { text: job.model || '' }),
      h('td', { text: job.fine_tuned_model || '—' }),
      h('td', { text: fmtTime(job.created_at) })));
    }
    if (S.jobs.selected) await refreshJobEvents(S.jobs.selected);
  }

  async function refreshJobEvents(id) {
    const answer = await api(`/v1/fine_tuning/jobs/${encodeURIComponent(id)}/events`, { query: { limit: 100 } });
    if (S.jobs.selected !== id) return;
    $('#job-events-title').textContent = `Events of ${id}`;
    const list = clear($('#job-events'));
    const events = (answer.data || []).slice().sort((a, b) => (a.created_at || 0) - (b.created_at || 0));
    for (const event of events) {
      list.append(h('li', { class: `event level-${event.level || 'info'}` },
        h('span', { class: 'muted', text: fmtTime(event.created_at) }),
        h('span', { class: 'event-type', text: event.level || '' }),
        h('span', { class: 'event-fields', text: event.message || '' })));
    }
    if (!events.length) list.append(h('li', { class: 'muted', text: 'No event.' }));
  }

  // -------------------------------------------------------------------------------------- wiring
  function wire() {
    $('#login-form').addEventListener('submit', login);
    $('#logout').addEventListener('click', logout);
    $('#status-close').addEventListener('click', () => { $('#status').hidden = true; });
    $$('#tabs button').forEach((button) => button.addEventListener('click', () => setTab(button.dataset.tab)));
    window.addEventListener('hashchange', () => {
      const name = location.hash.replace('#', '');
      if (S.started && name !== S.tab && PANELS[name]) setTab(name);
    });
    document.addEventListener('keydown', onKey);

    addTurn('user');
    $('#pg-add-turn').addEventListener('click', () => {
      const turns = $$('#pg-turns .turn');
      const last = turns.length ? $('.turn-role', turns[turns.length - 1]).value : 'assistant';
      $('.turn-content', addTurn(last === 'user' ? 'assistant' : 'user')).focus();
    });
    $('#pg-form').addEventListener('submit', sample);
    $('#pg-refresh-models').addEventListener('click', () => loadModelLists().catch(() => {}));
    $('#pg-rank-mode').addEventListener('change', toggleRankMode);
    $('#pg-send-ranking').addEventListener('click', sendRanking);
    $('#pg-clear-ranking').addEventListener('click', resetRanking);

    $('#inbox-filters').addEventListener('submit', (event) => { event.preventDefault(); loadInbox(); });
    $('#inbox-model').addEventListener('change', () => loadInbox());
    $('#inbox-more').addEventListener('click', () => loadInbox(true));

    $('#models-model').addEventListener('change', () => selectModel($('#models-model').value).catch(() => {}));
    $('#models-refresh').addEventListener('click', () => enterModels().catch(() => {}));
    $('#ct-enabled').addEventListener('change', toggleContinual);
    for (const id of ['ct-every', 'ct-replay', 'ct-guard-margin']) {
      $(`#${id}`).addEventListener('input', () => dirty.add(id));
    }
    $('#ct-objective').addEventListener('change', () => patchContinual({ objective: $('#ct-objective').value }));
    $('#ct-guard-enabled').addEventListener('change', () => {
      const guard = { enabled: $('#ct-guard-enabled').checked };
      const margin = numOrNull($('#ct-guard-margin').value);
      if (margin !== null) guard.margin = margin;
      patchContinual({ guard });
    });
    $('#ct-form').addEventListener('submit', async (event) => {
      event.preventDefault();
      if (await patchContinual(continualSettings())) showInfo('Continual training settings applied.');
    });

    $('#traj-filters').addEventListener('submit', (event) => { event.preventDefault(); loadTrajectories(); });
    $('#traj-more').addEventListener('click', () => loadTrajectories(true));
  }

  document.addEventListener('DOMContentLoaded', () => {
    wire();
    boot();
  });
})();
